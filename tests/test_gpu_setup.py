"""First-run GPU hazards (issue 20, part 2), each as the decision the code makes, tested on a CPU: what the
GPU memory line prints beside the planner, the process group bound to the rank's GPU, and what a CUDA
machine does with flash-attn. What only a GPU can show runs in bench/gpu.sh."""
import types

import pytest
import torch
import torch.distributed as dist
from common import init_processes, planner_assumptions, small_config

import model as M
from components import checks
from components import metrics
from components import offload as O
from tools import plan as P
import train as T

GIB = 2**30


def test_the_gpu_memory_line_puts_what_is_outside_the_allocator_beside_the_planners_allowance():
    line = metrics.device_memory_line("after step 1", free_bytes=4 * GIB, total_bytes=80 * GIB,
                                      reserved_bytes=73 * GIB, planned_gib=74.5, planned_context_gib=1.0)
    assert line == ("GPU memory after step 1: 76.00 GiB in use of 80.00 (mem_get_info), 73.00 reserved by "
                    "PyTorch's allocator, 3.00 outside it (CUDA context, NCCL, other processes) | planned 74.50 GiB, "
                    "1.00 of it outside the allocator: 2.00 GiB more than the planner allows")
    within = metrics.device_memory_line("after set-up", 70 * GIB, 80 * GIB, int(9.5 * GIB), 10.2, 1.0)
    assert within.endswith("0.50 outside it (CUDA context, NCCL, other processes) | planned 10.20 GiB, 1.00 of it "
                           "outside the allocator")
    unknown_gpu = metrics.device_memory_line("after step 1", 4 * GIB, 80 * GIB, 73 * GIB, None, None)
    assert "planned" not in unknown_gpu


def test_the_gpu_memory_is_printed_by_rank_0_on_cuda_beside_the_planners_figure(monkeypatch, capsys):
    """A stand-in for torch.cuda's queries: rank 0 prints after set-up and after step 1 with the planner's
    state and peak for the run as launched (W=16, 8 per node, the H100 CUDA names); other ranks and CPU
    runs print nothing."""
    mcfg = small_config()
    cfg = T.parse_args(["--seq_len", "64", "--batch_size", "16", "--micro_batch_size", "1"])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 19 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    sharded = types.SimpleNamespace(rank=0, world=16, device=torch.device("cuda", 0), model=types.SimpleNamespace(cfg=mcfg))
    expected = P.run_memory_gib(mcfg, cfg, 16, 8, "NVIDIA H100 80GB HBM3")
    two_nodes = P.fit_and_speed(mcfg, T.parse_args(["--seq_len", "64", "--batch_size", "16", "--micro_batch_size", "1",
                                                    "--nnodes", "2", "--nproc_per_node", "8", "--gpu", "h100"]))
    assert expected["peak_gib"] == two_nodes["peak_gib"] and expected["context_gib"] == cfg.outside_gib == 1.25
    metrics.print_device_memory(sharded, "after step 1", expected, "peak_gib")
    assert capsys.readouterr().out == metrics.device_memory_line("after step 1", 60 * GIB, 80 * GIB, 19 * GIB,
                                                                 expected["peak_gib"], 1.25) + "\n"
    for quiet in (dict(sharded.__dict__, rank=1), dict(sharded.__dict__, device=torch.device("cpu"))):
        metrics.print_device_memory(types.SimpleNamespace(**quiet), "after step 1", expected, "peak_gib")
    assert capsys.readouterr().out == ""
    assert P.run_memory_gib(mcfg, cfg, 16, 8, "Some Other GPU") is None


@pytest.mark.parametrize("device,rank_env", [("cuda", True), ("cuda", False), ("cpu", True)])
def test_the_nccl_group_is_bound_to_the_ranks_gpu_so_its_set_up_fails_at_start(monkeypatch, device, rank_env):
    """init_process_group(device_id=cuda:LOCAL_RANK) makes NCCL connect at once (a broken set-up fails before
    the first step, not at its first collective); gloo on CPU gets no device. The group is made on the store the
    ranks met in (processes.rendezvous: torchrun's, under RANK)."""
    calls, met = [], dist.HashStore()
    monkeypatch.setattr(T.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(T.dist, "rendezvous", lambda url, timeout: iter([(met, 3, 8)]))
    monkeypatch.setattr(T.dist, "init_process_group", lambda backend, **kwargs: calls.append((backend, kwargs)))
    monkeypatch.setattr(T.dist, "all_reduce", lambda tensor: None)  # the first contact's
    monkeypatch.setattr(T.torch, "ones", lambda n, device: torch.zeros(n))  # no CUDA here
    monkeypatch.setattr(T.torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(T.OD, "make_group", lambda timeout_min: None)
    monkeypatch.setenv("LOCAL_RANK", "3")
    if rank_env:
        monkeypatch.setenv("RANK", "3")
    else:
        monkeypatch.delenv("RANK", raising=False)
    rank, world, got = init_processes(T.parse_args(["--device", device]))
    [(backend, kwargs)] = calls
    assert (rank, world) == ((3, 8) if rank_env else (0, 1)) == (kwargs["rank"], kwargs["world_size"])
    kwargs["store"].set("k", "v")  # the store the ranks met in, under the trainer's prefix
    assert met.check(["zero3/k"]) == rank_env
    if device == "cuda":
        assert backend == "nccl" and kwargs["device_id"] == torch.device("cuda", 3) == got
    else:
        assert backend == "gloo" and "device_id" not in kwargs


def test_a_flash_attn_that_is_installed_but_does_not_import_is_kept_not_swallowed():
    """Not installed (ModuleNotFoundError for flash_attn itself) is SDPA, as meant; anything else (an ABI
    mismatch with this torch, its CUDA extension missing) is kept for checks.py to refuse on CUDA."""
    assert checks.flash_attn_import_problem(None) is None  # imported
    assert checks.flash_attn_import_problem(ModuleNotFoundError("No module named 'flash_attn'", name="flash_attn")) is None
    abi = ImportError(".../flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi")
    assert checks.flash_attn_import_problem(abi) == ("ImportError: .../flash_attn_2_cuda.so: undefined symbol: "
                                                     "_ZN3c104cuda9SetDeviceEi")
    no_extension = ModuleNotFoundError("No module named 'flash_attn_2_cuda'", name="flash_attn_2_cuda")
    assert checks.flash_attn_import_problem(no_extension) == "ModuleNotFoundError: No module named 'flash_attn_2_cuda'"


def test_model_keeps_the_import_error_of_a_broken_flash_attn(tmp_path):
    """model.py's own import, against a flash_attn package whose import fails as a wheel built for another
    torch does."""
    import subprocess
    import sys
    from common import ROOT
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text(
        "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')\n")
    proc = subprocess.run([sys.executable, "-c", "from components import checks; import model; print(checks.flash_attn_import_problem(model.FLASH_ATTN_IMPORT_ERROR))"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.stdout.strip() == "ImportError: flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi", proc.stderr


@pytest.mark.parametrize("device,cuda_available,refused", [
    ("auto", True, True), ("cuda", False, True), ("auto", False, False), ("cpu", True, False)])
def test_a_broken_flash_attn_is_an_error_on_a_cuda_machine(monkeypatch, device, cuda_available, refused):
    from components import checks
    import model as M
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_available)
    monkeypatch.setattr(M, "FLASH_ATTN_IMPORT_ERROR", ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c10"))
    errors = checks.check_flash_attn(T.parse_args(["--device", device]))
    assert errors == ([("flash_attn is installed but does not import (ImportError: flash_attn_2_cuda.so: undefined "
                        "symbol: _ZN3c10), so attention would silently run on SDPA: reinstall it for this torch (pip "
                        "install 'flash-attn>=2.7' --no-build-isolation), or uninstall it (pip uninstall flash-attn) "
                        "to use SDPA")] if refused else [])
    monkeypatch.setattr(M, "FLASH_ATTN_IMPORT_ERROR", None)  # installed and working
    assert checks.check_flash_attn(T.parse_args(["--device", device])) == []
    monkeypatch.setattr(M, "FLASH_ATTN_IMPORT_ERROR", ModuleNotFoundError("No module named 'flash_attn'", name="flash_attn"))
    assert checks.check_flash_attn(T.parse_args(["--device", device])) == []  # not installed: SDPA, as meant


def test_a_flash_attn_whose_attention_the_selective_policy_cannot_save_is_a_warning(monkeypatch):
    """flash-attn 2.5/2.6 register no torch op: train.SAVED_OPS holds none of flash_attn's, and --ac selective
    would recompute attention without a word. 2.7 registers both forward ops, which SAVED_OPS then holds."""
    import sys
    import model as M

    class Op:  # what str() of a registered op overload gives
        def __init__(self, name):
            self.name = name

        def __str__(self):
            return self.name
    monkeypatch.setattr(M, "flash_attn_func", lambda *args, **kwargs: None)
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(__version__="2.6.3"))
    assert checks.flash_attn_unsaved_warning(T.SAVED_OPS) == (
        "flash_attn 2.6.3 registers no torch op flash_attn::_flash_attn_varlen_forward (2.7 and later do): --ac "
        "selective cannot save attention's output and recomputes attention in backward; pip install "
        "'flash-attn>=2.7' --no-build-isolation")
    v27 = set(T.SAVED_OPS) | {Op("flash_attn._flash_attn_forward.default"), Op("flash_attn._flash_attn_varlen_forward.default")}
    assert checks.flash_attn_unsaved_warning(v27) is None
    monkeypatch.setattr(M, "flash_attn_func", None)  # not installed: SDPA, nothing to say
    assert checks.flash_attn_unsaved_warning(T.SAVED_OPS) is None


TORCH_OOM = ("CUDA out of memory. Tried to allocate 1.75 GiB. GPU 3 has a total capacity of 79.19 GiB of which 1.02 GiB "
             "is free. Including non-PyTorch memory, this process has 78.16 GiB memory in use.")


def test_an_out_of_memory_error_is_one_line_with_where_what_was_held_and_what_the_plan_predicted():
    try:
        T.Unit.free(None)  # any line of the trainer's: the error's place is read from its traceback
    except AttributeError as e:
        error = torch.OutOfMemoryError(TORCH_OOM).with_traceback(e.__traceback__)
    planned = dict(peak_gib=78.98, peak_phase="block recompute", context_gib=1.25,
                   phases_gib={"head backward": 77.06, "block recompute": 78.98, "optimizer step": 66.96})
    line = metrics.out_of_memory_line(error, 7, ["layers.40", "layers.41"],
                                      dict(allocated=76.5 * GIB, reserved=77.9 * GIB, peak=77.0 * GIB), planned)
    assert line.startswith("out of memory in step 7, at train.py:"), line
    assert (" in free (`if self._gather_work is not None:  # an error, not an assert: `python -O` must not skip it`), "
            "with layers.40, layers.41 gathered: CUDA out of memory. Tried to allocate 1.75 GiB; PyTorch's allocator "
            "held 76.50 GiB (77.90 reserved, at most 77.00 in this step); --plan predicted 78.98 GiB at the peak (block "
            "recompute; head backward 77.06, block recompute 78.98, optimizer step 66.96), 1.25 of it outside the "
            "allocator. A restart would run out again: lower the peak") in line, line
    assert "\n" not in line


def test_out_of_memory_in_a_step_stops_the_run_with_exit_2_not_a_restart_loop(main_in_process, tmp_path, monkeypatch,
                                                                              capfd):
    """A fake allocator error in layers.1's forward at step 2: one line naming the step, the line of code and the units
    gathered, exit 2 (before, exit 1 and "a restart may succeed": torchrun restarted into the same error)."""
    run_block = T.run_block

    def failing_block(block, ac, x, *args, **kwargs):
        if T.torch.is_grad_enabled() and kwargs.get("name", args[4] if len(args) > 4 else "") == "layers.1" and failing_block.step == 2:
            raise torch.OutOfMemoryError(TORCH_OOM)
        return run_block(block, ac, x, *args, **kwargs)
    failing_block.step = 0
    train_step = T.train_step

    def counted_step(cfg, sharded, windows, step, position):
        failing_block.step = step
        return train_step(cfg, sharded, windows, step, position)
    monkeypatch.setattr(T, "run_block", failing_block)
    monkeypatch.setattr(T, "train_step", counted_step)
    code = main_in_process(["--steps", "3", "--seq_len", "32", "--batch_size", "4", "--micro_batch_size", "2",
                            "--eval_every", "0", "--out_dir", str(tmp_path)])
    err = capfd.readouterr().err
    assert code == 2, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith("error: out of memory in step 2, at train.py:"), err[-2000:]
    assert " in run_stage (`return run_block(" in lines[0]  # the trainer's innermost line, not the test's stand-in
    assert ("with layers.1, layers.2 gathered: CUDA out of memory. Tried to allocate 1.75 GiB. A restart would run out "
            "again") in lines[0]  # layers.2: prefetched


def test_page_locking_is_timed_and_said_per_node_beside_the_plans_rate():
    gb = 1e9
    by_rank = [(53 * gb, 40.0), (53 * gb, 70.0), (60 * gb, 30.0), (53 * gb, 35.0)]
    line = metrics.page_locking_line(by_rank, ["node0", "node0", "node1", "node1"])
    assert line == ("host memory page-locked at start-up (cudaHostRegister, on the path to step 1): node0: 2 rank(s), "
                    "106.0 GB, the slowest rank 70.0 s (0.76 GB/s); node1: 2 rank(s), 113.0 GB, the slowest rank 35.0 s "
                    "(1.51 GB/s); --plan assumes 1 GB/s per rank for a restart's set-up")
    assert metrics.page_locking_line([(0, 0.0), (0, 0.0)], ["a", "b"]) is None  # a CPU, or nothing offloaded


def test_page_lock_records_what_it_locked_and_how_long_it_took(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: types.SimpleNamespace(
        cudaHostRegister=lambda ptr, nbytes, flags: calls.append(nbytes) or 0))
    monkeypatch.setattr(O, "PAGE_LOCKED", [])
    O.page_lock(torch.zeros(1000, dtype=torch.float32), "--async_save")
    assert calls == [4000] and len(O.PAGE_LOCKED) == 1 and O.PAGE_LOCKED[0][0] == 4000 and O.PAGE_LOCKED[0][1] >= 0


def test_the_mfu_convention_is_stated_where_document_masking_does_less_attention_than_it_counts():
    mcfg = small_config()
    units = [types.SimpleNamespace(persistent_bytes=lambda on_device_only=False: 0)]
    sharded = types.SimpleNamespace(model=types.SimpleNamespace(cfg=mcfg), world=1, device=torch.device("cpu"),
                                    units=units, compute_dtype=torch.float32)
    masked, causal = (metrics.startup_line(T.parse_args(["--doc_mask", flag]), sharded, 0) for flag in ("true", "false"))
    assert masked.endswith(" | MFU counts attention over the whole window (causal), not per document: more than "
                           "--doc_mask runs")
    assert "MFU counts" not in causal
    assert "--doc_mask" in M.flops_per_token.__doc__
    assert "--doc_mask" in planner_assumptions()["model"]["mfu_convention"][0]  # docs/planning.md
