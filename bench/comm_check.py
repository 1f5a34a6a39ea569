"""All-reduce bus bandwidth across the job's ranks: run before a multi-day job to see which link carries
the traffic (`./launch.sh --check` runs this under the same torchrun as training).

Bus bandwidth = bytes x 2 (W - 1) / W / time, the NCCL-tests convention: what each rank's link carries
in a ring all-reduce, comparable across world sizes. On 2 x 8 H100 with 8 x 400 Gb/s InfiniBand per node
expect tens of GB/s at the larger sizes; single-digit GB/s between nodes means TCP is carrying the
traffic (run again with NCCL_DEBUG=INFO and look for NET/IB rather than NET/Socket).
"""
import os
import time

import torch
import torch.distributed as dist


def main():
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    sizes_mb = [1, 16, 256, 1024] if use_cuda else [1, 16, 64]
    if rank == 0:
        print(f"all-reduce over {world} ranks ({'nccl' if use_cuda else 'gloo'}, "
              f"{int(os.environ.get('LOCAL_WORLD_SIZE', world))} per node)")
    for size_mb in sizes_mb:
        x = torch.ones(size_mb * 2**20 // 4, dtype=torch.float32, device=device)
        for _ in range(2):  # warm-up: connections, buffers
            dist.all_reduce(x)
        iters = 5
        if use_cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        if use_cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / iters
        busbw = x.numel() * 4 * 2 * (world - 1) / world / seconds / 1e9
        if rank == 0:
            print(f"{size_mb:6d} MiB  {seconds * 1e3:9.2f} ms  bus bandwidth {busbw:8.2f} GB/s", flush=True)
    ok = torch.tensor([float(world)], device=device)
    dist.all_reduce(ok)
    assert ok.item() == world * world, "all-reduce gave a wrong sum"
    if rank == 0:
        print("all-reduce results correct on every rank")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)  # as train.py: no interpreter teardown after destroy_process_group
