"""Every rank runs the same job (components/agree.py): what a rank reads from its own machine (host memory,
packages, limits, the address gloo binds, the checkpoints it sees) is gathered from every rank and decided
the same on every rank, or refused on every rank in one line per problem, before any weights are read.

The decisions are pure functions of every rank's facts, tested here on facts as two nodes would report them;
two runs under torchrun show the whole path, each rank patched to see its own machine (tests/dist_worker.py
facts): a refusal before step 1 on every rank, and a resume where rank 1's view of the out_dir is stale."""
import errno
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from common import DIST_WORKER, ROOT, model_and_tokens, read_metrics, run_script, run_train, stopped_at
from ranks import run_ranks

from components import agree  # noqa: E402
from components import checkpoints  # noqa: E402
from components import out_dir as OD  # noqa: E402
from tools import gpu_check  # noqa: E402  the device health check a run runs (agree.device_health)
import train as T  # noqa: E402

GIB = 2**30


def node_facts(host, **changes) -> dict:
    """One rank's facts as read_facts reports them on a healthy GPU node."""
    facts = dict(host=host, netns=f"boot-of-{host}/4026531840", code="5e1f0c2a9b7d3e41", flags=dict(lr=1e-4, steps=1000, out_dir="/shared/run"),
                 model=dict(dim=8192, vocab_size=128256), data=[1200000, 300000],
                 torch="2.13.0", flash_attn="2.7.4", nccl="2.27.3", gloo="10.0.0.1", memlock=-1, ipc_lock=False,
                 shm_free=64 * GIB, gpu=dict(index=0, free=78 * GIB, total=80 * GIB, reserved=0, need=70 * GIB),
                 driver="550.54.15", gpu_model="NVIDIA H100 80GB HBM3", nccl_conf=None,
                 env=dict(NCCL_NVLS_ENABLE="0", PYTORCH_ALLOC_CONF="expandable_segments:True"),
                 inputs=dict(eval_data="9a1b2c3d4e5f6071", sample_prompts=None,
                             init_from=dict(headers="0f1e2d3c4b5a6978", sampled="1122334455667788")),
                 async_save=True, problems=[], warnings=[])
    facts.update(changes)
    return facts


def two_nodes(**node1) -> list[dict]:
    """Ranks 0-1 on node0, ranks 2-3 on node1 (whose facts differ by `node1`)."""
    return [node_facts("node0"), node_facts("node0"), node_facts("node1", **node1), node_facts("node1", **node1)]


def test_a_healthy_two_node_job_has_nothing_to_say():
    assert agree.decide(two_nodes()) == ([], [], True)


def test_who_names_ranks_as_spans_and_their_hosts():
    hosts = ["a"] * 8 + ["b"] * 8
    assert agree.who([3], hosts) == "rank 3 (a)"
    assert agree.who(list(range(8, 16)), hosts) == "ranks 8-15 (b)"
    assert agree.who([0, 1, 2, 3, 9], hosts) == "ranks 0-3, 9 (a, b)"


def test_async_save_auto_is_decided_by_the_tightest_node():
    """Node 1 has less host memory: --async_save auto is off on every rank (a rank saving in the background while
    another saves synchronously pairs the collectives wrong at the first save), and node 1's reason is printed."""
    note = "--async_save auto: off: the 2 rank(s) on this node would need 120.0 GiB of host memory"
    problems, warnings, async_save = agree.decide(two_nodes(async_save=False, warnings=[note]))
    assert (problems, async_save) == ([], False)
    assert warnings == [f"ranks 2-3 (node1): {note}"]


def test_a_line_every_rank_says_is_printed_once_as_it_is():
    facts = [node_facts("node0", warnings=["--warmup_steps 20 is not below --steps 3"]) for _ in range(4)]
    assert agree.decide(facts)[1] == ["--warmup_steps 20 is not below --steps 3"]


@pytest.mark.parametrize("key, node1_value, what", [("flash_attn", None, "flash-attn"),
                                                   ("flash_attn", "2.6.3", "flash-attn"),
                                                   ("torch", "2.12.1", "torch"), ("nccl", "2.21.5", "NCCL")])
def test_another_version_on_one_node_is_refused_naming_both(key, node1_value, what):
    [line] = agree.decide(two_nodes(**{key: node1_value}))[0]
    node0 = node_facts("node0")[key]
    assert line == (f"{what} differs between ranks: {node0} on ranks 0-1 (node0); {node1_value or 'not installed'} on "
                    f"ranks 2-3 (node1); install the same {what} on every node")


@pytest.mark.parametrize("key, node1_value, line", [
    ("flags", dict(lr=2e-4, steps=1000, out_dir="/shared/run"),
     "--lr differs between ranks: 0.0001 on ranks 0-1 (node0); 0.0002 on ranks 2-3 (node1); the same command on every node"),
    ("model", dict(dim=8192, vocab_size=128000),
     "the model's vocab_size differs between ranks: 128256 on ranks 0-1 (node0); 128000 on ranks 2-3 (node1); the same "
     "--init_from (config.json) and data (its tokenizer) on every node"),
    ("data", [1200000, 200000], "--data (windows per source) differs between ranks: [1200000, 300000] on ranks 0-1 "
     "(node0); [1200000, 200000] on ranks 2-3 (node1); the same files on every node"),
    ("code", "0d9c1e2f3a4b5c6d", "the trainer's code (train.py, model.py, data.py, components/) differs between ranks: "
     "5e1f0c2a9b7d3e41 on ranks 0-1 (node0); 0d9c1e2f3a4b5c6d on ranks 2-3 (node1); the same checkout on every node")])
def test_a_node_given_another_command_model_data_or_code_is_refused(key, node1_value, line):
    """Each node is launched by hand or by its own srun task: nothing but this compares what each was given."""
    assert agree.decide(two_nodes(**{key: node1_value})) == ([line], [], False)


def test_a_folder_a_node_reaches_by_another_path_is_compared_by_what_it_holds():
    """--out_dir, --init_from, --data under another mount point are the same job: what they hold is compared (the
    model, the data's windows, the out_dir's lock)."""
    assert agree.decide(two_nodes(flags=dict(lr=1e-4, steps=1000, out_dir="/mnt/shared/run"))) == ([], [], True)


def test_the_code_fingerprint_reads_the_trainers_files():
    assert agree.code_sha256() == agree.code_sha256() and len(agree.code_sha256()) == 16


def test_a_64_kib_memlock_limit_is_refused_on_a_gpu_job_across_nodes():
    [line] = agree.decide(two_nodes(memlock=64 * 1024))[0]
    assert line.startswith("ranks 2-3 (node1): the locked-memory limit is 0.0625 MiB (ulimit -l) and the process lacks "
                           "CAP_IPC_LOCK: NCCL cannot register its InfiniBand buffers; run with `ulimit -l unlimited`"), line
    one_node = [node_facts("node0", memlock=64 * 1024) for _ in range(2)]
    assert agree.decide(one_node)[0] == []  # NVLink within a node: nothing registered with an HCA
    on_cpu = [node_facts(h, memlock=64 * 1024, nccl=None, gpu=None) for h in ("node0", "node1")]
    assert agree.decide(on_cpu)[0] == []  # gloo


def test_a_hostname_on_a_loopback_address_is_refused_when_the_job_spans_nodes():
    [line] = agree.decide(two_nodes(gloo="127.0.1.1"))[0]
    assert line.startswith("ranks 2-3 (node1): the hostname node1 resolves to 127.0.1.1, a loopback address: gloo "
                           "(the checkpoint group: every save and resume) would listen there"), line
    assert "GLOO_SOCKET_IFNAME" in line
    assert agree.decide([node_facts("node0", gloo="127.0.1.1") for _ in range(2)])[0] == []  # one node: fine
    one_machine = [node_facts("n1", gloo="127.0.0.1", netns="b/1"), node_facts("n2", gloo="127.0.0.1", netns="b/1")]
    assert agree.decide(one_machine)[0] == []  # SLURM's two nodes on one machine: one loopback for both
    assert agree.decide(two_nodes(gloo=None))[0] == []  # GLOO_SOCKET_IFNAME set: the user chose


def test_the_address_gloo_binds_is_read_as_gloo_reads_it(monkeypatch):
    monkeypatch.setattr(agree.socket, "getaddrinfo", lambda host, port, type: [
        (agree.socket.AF_INET, type, 6, "", ("127.0.1.1", 0))] if host == "node1" else [])
    assert agree.gloo_address("node1", env={}) == "127.0.1.1"
    assert agree.gloo_address("node1", env={"GLOO_SOCKET_IFNAME": "eth0"}) is None
    assert agree.gloo_address("unknown", env={}) == "127.0.0.1"  # gloo falls back to the loopback address


def test_a_small_dev_shm_and_a_gpu_another_process_holds_are_refused():
    [line] = agree.decide(two_nodes(shm_free=64 * 2**20))[0]
    assert line.startswith("ranks 2-3 (node1): /dev/shm has 64 MiB free: NCCL's shared memory between the node's 2 "
                           "ranks needs more"), line
    held = dict(index=1, free=30 * GIB, total=80 * GIB, reserved=GIB, need=70 * GIB)
    facts = two_nodes()
    facts[3] = node_facts("node1", gpu=held)
    [line] = agree.decide(facts)[0]
    assert line.startswith("rank 3 (node1): GPU 1 has 30.0 GiB free of 80.0, and the run needs 70.0 GiB for PyTorch "
                           "at its peak (--plan's, less the context); 49.0 GiB are held outside"), line


def test_a_rank_s_own_problem_is_named_with_its_rank_and_host():
    facts = two_nodes()
    facts[2]["problems"] = ["flash_attn is installed but does not import (ImportError: undefined symbol)"]
    assert agree.decide(facts)[0] == ["rank 2 (node1): flash_attn is installed but does not import (ImportError: "
                                      "undefined symbol)"]


# -- more facts compared, the overrides (issue 51) -----------------------------------------------------------

@pytest.mark.parametrize("node1, line", [
    (dict(env=dict(NCCL_NVLS_ENABLE="0", PYTORCH_ALLOC_CONF="expandable_segments:True", NCCL_IB_HCA="mlx5_0")),
     "the environment variable NCCL_IB_HCA differs between ranks: unset on ranks 0-1 (node0); mlx5_0 on ranks 2-3 "
     "(node1); export the same NCCL and allocator settings on every node"),
    (dict(env=dict(NCCL_NVLS_ENABLE="1", PYTORCH_ALLOC_CONF="expandable_segments:True")),
     "the environment variable NCCL_NVLS_ENABLE differs between ranks: 0 on ranks 0-1 (node0); 1 on ranks 2-3 (node1); "
     "export the same NCCL and allocator settings on every node"),
    (dict(env=dict(NCCL_NVLS_ENABLE="0", PYTORCH_ALLOC_CONF="expandable_segments:True", TORCH_NCCL_BLOCKING_WAIT="1")),
     "the environment variable TORCH_NCCL_BLOCKING_WAIT differs between ranks: unset on ranks 0-1 (node0); 1 on ranks "
     "2-3 (node1); export the same NCCL and allocator settings on every node"),
    (dict(env=dict(NCCL_NVLS_ENABLE="0", PYTORCH_ALLOC_CONF="max_split_size_mb:512")),
     "the environment variable PYTORCH_ALLOC_CONF differs between ranks: expandable_segments:True on ranks 0-1 (node0); "
     "max_split_size_mb:512 on ranks 2-3 (node1); export the same NCCL and allocator settings on every node"),
    (dict(nccl_conf="77aa88bb99cc00dd"), "/etc/nccl.conf (its SHA-256) differs between ranks: absent on ranks 0-1 "
     "(node0); 77aa88bb99cc00dd on ranks 2-3 (node1); the same /etc/nccl.conf on every node, or none"),
    (dict(driver="535.161.08"), "the GPU driver differs between ranks: 550.54.15 on ranks 0-1 (node0); 535.161.08 on "
     "ranks 2-3 (node1); the same NVIDIA driver on every node"),
    (dict(gpu_model="NVIDIA H100 PCIe"), "the GPU model differs between ranks: NVIDIA H100 80GB HBM3 on ranks 0-1 "
     "(node0); NVIDIA H100 PCIe on ranks 2-3 (node1); one GPU model for the whole job (sbatch --constraint, or "
     "--exclude the other nodes)")])
def test_each_setting_that_differs_on_one_node_is_one_line_naming_it(node1, line):
    assert agree.decide(two_nodes(**node1)) == ([line], [], True)


WEIGHTS = dict(headers="0f1e2d3c4b5a6978", sampled="1122334455667788")


@pytest.mark.parametrize("inputs, line", [
    (dict(eval_data="0000aaaa1111bbbb", sample_prompts=None, init_from=WEIGHTS),
     "--eval_data (a sampled digest of its files) differs between ranks: 9a1b2c3d4e5f6071 on ranks 0-1 (node0); "
     "0000aaaa1111bbbb on ranks 2-3 (node1); the same files on every node"),
    (dict(eval_data="9a1b2c3d4e5f6071", sample_prompts="5555666677778888", init_from=WEIGHTS),
     "--sample_prompts (its SHA-256) differs between ranks: None on ranks 0-1 (node0); 5555666677778888 on ranks 2-3 "
     "(node1); the same files on every node"),
    (dict(eval_data="9a1b2c3d4e5f6071", sample_prompts=None, init_from=dict(WEIGHTS, headers="ffffeeeeddddcccc")),
     "--init_from's safetensors headers (tensor names, dtypes, shapes, offsets) differs between ranks: 0f1e2d3c4b5a6978 "
     "on ranks 0-1 (node0); ffffeeeeddddcccc on ranks 2-3 (node1); the same model files on every node"),
    (dict(eval_data="9a1b2c3d4e5f6071", sample_prompts=None, init_from=dict(WEIGHTS, sampled="9999999999999999")),
     "--init_from's weights (a digest of 16 pieces of each file) differs between ranks: 1122334455667788 on ranks 0-1 "
     "(node0); 9999999999999999 on ranks 2-3 (node1); the same model files on every node (a copy cut short or another "
     "revision?)")])
def test_a_file_a_node_reads_otherwise_is_refused_by_its_content(inputs, line):
    """Before, --eval_data, --sample_prompts and --init_from's weights were excluded from the comparison by path
    (FILE_FLAGS) and compared by nothing else: a node with another copy trained another job."""
    assert agree.decide(two_nodes(inputs=inputs)) == ([line], [], False)


def test_the_weights_digests_read_the_safetensors_headers_and_sampled_pieces(tmp_path, monkeypatch):
    from safetensors.torch import save_file
    monkeypatch.setattr(agree, "SAMPLED_WHOLE_BYTES", 1024)  # the pieces, not the whole file, at this size
    monkeypatch.setattr(agree, "SAMPLED_CHUNK_BYTES", 256)
    tensors = {"model.embed_tokens.weight": T.torch.arange(4096, dtype=T.torch.float32).reshape(64, 64)}
    for name in ("a", "b", "bf16", "cut"):
        (tmp_path / name).mkdir()
    save_file(tensors, str(tmp_path / "a" / "model.safetensors"))
    save_file(tensors, str(tmp_path / "b" / "model.safetensors"))  # the same bytes under another path
    save_file({k: v.bfloat16() for k, v in tensors.items()}, str(tmp_path / "bf16" / "model.safetensors"))
    data = bytearray((tmp_path / "a" / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # the last piece always sampled: a file cut short or corrupted at its end
    (tmp_path / "cut" / "model.safetensors").write_bytes(bytes(data))
    a, b, bf16, cut = (agree.weights_digests(str(tmp_path / n)) for n in ("a", "b", "bf16", "cut"))
    assert a == b and a["headers"] and a["sampled"]
    assert bf16["headers"] != a["headers"]  # another dtype: the header says so
    assert cut["headers"] == a["headers"] and cut["sampled"] != a["sampled"]
    assert agree.weights_digests(str(tmp_path)) is None  # no safetensors: a checkpoint of ours


def test_the_settings_facts_are_read_from_the_environment_and_the_files(tmp_path):
    env = dict(NCCL_IB_HCA="mlx5", TORCH_NCCL_BLOCKING_WAIT="1", PYTORCH_CUDA_ALLOC_CONF="x", PATH="/bin",
               GLOO_SOCKET_IFNAME="eth0", MY_NCCL_NOTE="no")
    assert agree.nccl_settings(env) == dict(NCCL_IB_HCA="mlx5", PYTORCH_CUDA_ALLOC_CONF="x", TORCH_NCCL_BLOCKING_WAIT="1")
    version = tmp_path / "version"
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n")
    assert agree.gpu_driver(str(version)) == "550.54.15"
    assert agree.gpu_driver(str(tmp_path / "absent")) is None
    (tmp_path / "prompts.jsonl").write_text('{"text": "Bonjour"}\n')
    assert agree.file_sha256(str(tmp_path / "prompts.jsonl")) == agree.hashlib.sha256(b'{"text": "Bonjour"}\n').hexdigest()[:16]


@pytest.mark.parametrize("cap_eff, can", [("00000000a80425fb", False),  # docker's default set
                                          ("00000000a80465fb", True),   # --cap-add IPC_LOCK
                                          ("000001ffffffffff", True)])  # a privileged root container
def test_cap_ipc_lock_is_read_from_the_effective_capabilities(tmp_path, cap_eff, can):
    status = tmp_path / "status"
    status.write_text(f"Name:\tpython\nCapInh:\t0000000000000000\nCapEff:\t{cap_eff}\n")
    assert agree.can_lock_any_memory(str(status)) is can


def test_a_low_memlock_is_not_refused_with_cap_ipc_lock_or_its_override():
    """A root container with CAP_IPC_LOCK locks any amount whatever ulimit -l says (the kernel's mlock and
    InfiniBand's ib_umem_get skip the limit for it): refusing it was wrong. --allow_low_memlock, named in the line,
    overrides the refusal otherwise."""
    assert agree.decide(two_nodes(memlock=64 * 1024, ipc_lock=True))[0] == []
    [line] = agree.decide(two_nodes(memlock=64 * 1024))[0]
    assert line.endswith("or --allow_low_memlock if the nodes talk without InfiniBand"), line
    allowed = [dict(f, flags=dict(f["flags"], allow_low_memlock=True)) for f in two_nodes(memlock=64 * 1024)]
    assert agree.decide(allowed)[0] == []


def test_dev_shm_is_judged_by_what_it_has_free_with_an_override(monkeypatch):
    """A large /dev/shm that earlier jobs' leftovers fill fails NCCL as a small one does: the fact is what is free
    (statvfs f_bavail), not the size; --allow_small_shm, named in the line, overrides it."""
    monkeypatch.setattr(agree.os, "statvfs", lambda path: agree.os.statvfs_result((4096, 4096, 2**24, 2**23, 1000,
                                                                                   0, 0, 0, 0, 255)))
    assert agree.shm_free_bytes() == 1000 * 4096  # 64 GiB in size, 4 MB free
    [line] = agree.decide(two_nodes(shm_free=1000 * 4096))[0]
    assert line.startswith("ranks 2-3 (node1): /dev/shm has 3.90625 MiB free") and line.endswith(
        "or --allow_small_shm if NCCL_SHM_DISABLE=1 keeps NCCL out of it"), line
    allowed = [dict(f, flags=dict(f["flags"], allow_small_shm=True)) for f in two_nodes(shm_free=1000 * 4096)]
    assert agree.decide(allowed)[0] == []


def test_the_override_flags_parse():
    cfg = T.parse_args(["--allow_low_memlock", "--allow_small_shm"])
    assert cfg.allow_low_memlock and cfg.allow_small_shm
    assert not T.parse_args([]).allow_low_memlock


# -- each GPU's health (tools/gpu_check.py's facts), the clocks, the allocator's setting (issue 51) ---------------

H100_ECC = """
==============NVSMI LOG==============
GPU 00000000:18:00.0
    ECC Mode
        Current                           : Enabled
        Pending                           : Enabled
    ECC Errors
        Volatile
            SRAM Correctable              : 0
            SRAM Uncorrectable Parity     : 0
            SRAM Uncorrectable SEC-DED    : 0
            DRAM Correctable              : 12
            DRAM Uncorrectable            : {dram}
        Aggregate
            SRAM Correctable              : 0
            DRAM Uncorrectable            : 7
    Remapped Rows
        Correctable Error                 : 0
        Uncorrectable Error               : 1
        Pending                           : {pending}
        Remapping Failure Occurred        : No
        Bank Remap Availability Histogram
            Max                           : 639 bank(s)
"""

V100_ECC = """
    ECC Errors
        Volatile
            Single Bit
                Device Memory             : 3
                Total                     : 3
            Double Bit
                Device Memory             : 2
                Register File             : N/A
                Total                     : 2
        Aggregate
            Double Bit
                Total                     : 9
"""


def test_ecc_and_row_remapping_are_read_from_nvidia_smi_as_it_prints_them():
    assert gpu_check.ecc_state(H100_ECC.format(dram=0, pending="No")) == dict(volatile_uncorrectable=0, remap_pending=False,
                                                                         remap_failed=False)
    assert gpu_check.ecc_state(H100_ECC.format(dram=2, pending="Yes")) == dict(volatile_uncorrectable=2, remap_pending=True,
                                                                          remap_failed=False)
    assert gpu_check.ecc_state(V100_ECC)["volatile_uncorrectable"] == 2  # Double Bit's volatile total; aggregate is history
    assert gpu_check.ecc_state("") == dict(volatile_uncorrectable=0, remap_pending=False, remap_failed=False)


def health(what="GPU 0", ms=20.0, wrong=False, ecc=None, clock_s=1000.0, meet_s=0.01, warnings=()):
    facts = dict(what=what, n=8192, matmul_ms=ms, wrong=wrong, ecc=ecc, clock_s=clock_s, meet_s=meet_s,
                 warnings=list(warnings))
    return dict(facts, problems=gpu_check.device_problems(facts))  # as tools/gpu_check.py's --json says them


def test_a_gpu_that_computes_wrongly_or_reports_uncorrectable_errors_is_a_problem_naming_the_node_to_exclude():
    healthy = dict(volatile_uncorrectable=0, remap_pending=False, remap_failed=False)
    ranks = [health(), health(wrong=True, what="GPU 1"), health(ecc=dict(healthy, volatile_uncorrectable=2), what="GPU 0"),
             health(ecc=dict(healthy, remap_pending=True), what="GPU 1")]
    problems, warnings = agree.decide_health(ranks, HOSTS)
    assert problems == [
        "rank 1 (node0): GPU 1's check matmul (8192 x 8192, exact integers) gave a wrong result: the device computes "
        "wrongly; leave the node out (sbatch --exclude=node0) and have it tested (dcgmi diag)",
        "rank 2 (node1): GPU 0 reports 2 uncorrectable ECC error(s) since the driver loaded (nvidia-smi -q -d ECC): it "
        "will crash this run as it did the last; leave the node out (sbatch --exclude=node1) and reset the GPU",
        "rank 3 (node1): GPU 1: a row remapping is pending until a reset (nvidia-smi -q -d ROW_REMAPPER); leave the node "
        "out (sbatch --exclude=node1) and reset the GPU (a failed remapping: replace it)"]
    assert warnings == []


def test_a_gpu_more_than_20_percent_slower_than_the_median_is_named_and_one_within_it_is_not():
    problems, warnings = agree.decide_health([health(ms=20.0), health(ms=20.2), health(ms=20.4), health(ms=25.0)],
                                             HOSTS)
    assert problems == [] and len(warnings) == 1
    assert warnings[0].startswith("rank 3 (node1): GPU 0's check matmul took 25.0 ms, 23% over the ranks' median "
                                  "20.3 ms"), warnings[0]
    assert "leave the node out (sbatch --exclude=node1)" in warnings[0]
    assert agree.decide_health([health(ms=20.0)] * 3 + [health(ms=23.9)], HOSTS) == ([], [])  # 19.5% over


def test_a_clock_skew_is_named_beyond_what_the_reading_can_tell():
    """The readings follow a meeting every rank leaves within its duration (meet_s): a skew within
    CLOCK_SKEW_MOST_S plus that is not named."""
    ranks = [health(clock_s=1000.0), health(clock_s=1000.2), health(clock_s=1012.0), health(clock_s=1012.1)]
    [line] = agree.decide_health(ranks, HOSTS)[1]
    assert line.startswith("the ranks' clocks differ by 12.1 s (measured to within 0.01 s): node0 +0.0 s, node1 "
                           "+12.0 s (each node's first rank, from the earliest clock)"), line
    assert "chronyc tracking" in line
    slow_meeting = [dict(h, meet_s=8.0) for h in ranks]
    assert agree.decide_health(slow_meeting, HOSTS)[1] == []  # 12.1 s apart, but known only to within 8 s


def test_the_check_matmul_is_exact_and_a_wrong_entry_is_found(monkeypatch):
    assert gpu_check.check_matmul(T.torch.device("cpu"), 0)["wrong"] is False
    monkeypatch.setattr(gpu_check.flags, "fault_hook", lambda where, step, rank, product: product.view(-1).__setitem__(
        5, product.view(-1)[5] + 1))
    assert gpu_check.check_matmul(T.torch.device("cpu"), 0)["wrong"] is True


def gpu_check_run(*args, rank=0, fault=""):
    """tools/gpu_check.py on this CPU, as a run's rank `rank` runs it (RANK from torchrun), with the tests' fault
    (tests/fault_site reaches it: common.py puts that folder on PYTHONPATH)."""
    env = dict(os.environ, RANK=str(rank), ZERO3_FAULT=fault, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"), "--device", "cpu", *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_the_device_check_by_hand_prints_a_line_per_device_and_exits_1_on_a_wrong_result():
    clean = gpu_check_run()
    assert clean.returncode == 0, clean.stderr[-2000:]
    assert clean.stdout.startswith("CPU: check matmul 384 x 384 exact, "), clean.stdout
    assert "(fastest of 5); ECC and row remapping not read (no nvidia-smi, or a CPU)" in clean.stdout
    wrong = gpu_check_run(rank=1, fault="wrong_matmul:1")
    assert wrong.returncode == 1, wrong.stderr[-2000:]
    assert wrong.stdout.startswith("error: CPU: check matmul 384 x 384 WRONG: the device computes wrongly, have it "
                                   "tested (dcgmi diag), "), wrong.stdout
    assert len(wrong.stdout.splitlines()) == 1


def test_the_device_check_by_hand_names_ecc_and_remapping_problems_and_a_device_that_cannot_run_it(monkeypatch, capsys):
    healthy = dict(what="GPU 3", name="NVIDIA H100 80GB HBM3", n=8192, matmul_ms=19.84, wrong=False, warnings=[],
                   ecc=dict(volatile_uncorrectable=0, remap_pending=False, remap_failed=False))
    assert gpu_check.device_line(healthy) == ("GPU 3 (NVIDIA H100 80GB HBM3): check matmul 8192 x 8192 exact, 19.84 ms "
                                              "(fastest of 5); 0 uncorrectable ECC error(s) since the driver loaded, no "
                                              "row remapping pending or failed")
    ecc = dict(healthy, ecc=dict(healthy["ecc"], volatile_uncorrectable=2, remap_pending=True))
    assert gpu_check.device_line(ecc).startswith("error: GPU 3 (NVIDIA H100 80GB HBM3): check matmul 8192 x 8192 exact")
    assert gpu_check.device_line(ecc).endswith("2 uncorrectable ECC error(s) since the driver loaded, a row remapping "
                                               "pending until a reset")
    failed = dict(healthy, ecc=dict(healthy["ecc"], remap_failed=True))
    assert gpu_check.unhealthy(failed) and gpu_check.device_line(failed).endswith("a row remapping failed: replace the GPU")

    def cuda_error(device, rank):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors ...")
    monkeypatch.setattr(gpu_check, "device_facts", cuda_error)
    assert gpu_check.main(["--device", "cpu"]) == 1
    assert capsys.readouterr().out == ("error: cpu: the check could not run (CUDA error: an illegal memory access was "
                                       "encountered)\n")


def test_the_ranks_facts_the_device_check_prints_are_decided_across_ranks():
    """What tests/test_faults.py's runs show end to end, from the tool's JSON on the CPU: rank 1's check matmul made
    wrong is a problem naming rank 1, its host and the node to exclude; rank 1's slowed by 50 ms of CPU a time is a
    warning (the run goes on: a slow GPU slows the job, it does not break it)."""
    def facts(rank, fault):
        proc = gpu_check_run("--json", rank=rank, fault=fault)
        assert proc.returncode == 0, proc.stderr[-2000:]
        [one] = json.loads(proc.stdout)
        return dict(one, clock_s=1000.0, meet_s=0.01)  # read_health adds the clock
    hosts, rank_0 = ["node0", "node1"], facts(0, "")  # as rank 0 runs it with either fault: no fault on rank 0
    problems, warnings = agree.decide_health([rank_0, facts(1, "wrong_matmul:1")], hosts)
    assert problems == ["rank 1 (node1): CPU's check matmul (384 x 384, exact integers) gave a wrong result: the device "
                        "computes wrongly; leave the node out (sbatch --exclude=node1) and have it tested (dcgmi diag)"]
    assert warnings == []
    problems, warnings = agree.decide_health([rank_0, facts(1, "slow_matmul:1:0.05")], hosts)
    assert problems == [] and len(warnings) == 1, warnings
    assert warnings[0].startswith("rank 1 (node1): CPU's check matmul took ") and "over the ranks' median" in warnings[0]
    assert "leave the node out (sbatch --exclude=node1)" in warnings[0]


def test_a_cpu_run_skips_the_device_check_and_a_check_that_fails_is_one_warning(monkeypatch):
    """On a CPU a rank says only its clock; a device check that cannot run (here: no tool) is a warning said once,
    and the ranks whose device was checked are still decided among themselves."""
    cpu = T.torch.device("cpu")
    monkeypatch.delenv("ZERO3_GPU_CHECK_ON_CPU", raising=False)
    assert agree.device_health(cpu) == dict(warnings=[])
    monkeypatch.setenv("ZERO3_GPU_CHECK_ON_CPU", "1")
    monkeypatch.setattr(agree, "GPU_CHECK", "/nonexistent/gpu_check.py")
    [line] = agree.device_health(cpu)["warnings"]
    assert line.startswith("the device health check is missing (/nonexistent/gpu_check.py: "), line
    assert line.endswith("; the run goes on without it")
    clock = dict(clock_s=1000.0, meet_s=0.01)
    unchecked = dict(clock, warnings=[line])
    problems, warnings = agree.decide_health([dict(health(ms=20.0), **clock), unchecked, health(ms=20.2),
                                              health(ms=25.0, wrong=True)], HOSTS)
    assert [p[:28] for p in problems] == ["rank 3 (node1): GPU 0's chec"]
    assert warnings[0].startswith("rank 3 (node1): GPU 0's check matmul took 25.0 ms, 24% over the ranks' median "
                                  "20.2 ms"), warnings  # ranks 0, 2 and 3: rank 1 has no figure
    assert warnings[1:] == [f"rank 1 (node0): {line}"]
    assert agree.decide_health([dict(clock, warnings=[])] * 4, HOSTS) == ([], [])  # a CPU run: the clocks alone


def test_an_allocator_setting_not_in_effect_is_a_warning():
    env = dict(PYTORCH_ALLOC_CONF="expandable_segments:True")
    line = gpu_check.alloc_conf_warning(env, dict(expandable_segments=False), "2.9.1+cu128")
    assert line.startswith("PYTORCH_ALLOC_CONF asks for expandable_segments:True, but torch 2.9.1+cu128's CUDA allocator "
                           "runs without it"), line
    assert "pytorch/pytorch#183387" in line
    assert gpu_check.alloc_conf_warning(env, dict(expandable_segments=True), "2.13.0") is None
    assert gpu_check.alloc_conf_warning(env, None, "2.13.0") is None  # not readable here: no fact
    assert gpu_check.alloc_conf_warning({}, dict(expandable_segments=False), "2.13.0") is None  # not asked for


@pytest.mark.parametrize("version, both", [("2.8.0+cu128", True), ("2.9.1+cu128", True), ("2.10.0", True),
                                           ("2.11.0", False), ("2.13.0+cpu", False)])
def test_the_allocator_setting_is_set_under_both_names_where_torch_reads_only_the_old_one(tmp_path, version, both):
    env = {}
    agree.launch_settings(str(tmp_path), env, torch_version=version)
    assert env["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    assert env.get("PYTORCH_CUDA_ALLOC_CONF") == ("expandable_segments:True" if both else None)
    mine = dict(PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:512")  # the user's, under the old name: kept, alone
    agree.launch_settings(str(tmp_path), mine, torch_version=version)
    assert "PYTORCH_ALLOC_CONF" not in mine and mine["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"


# -- the checkpoint to resume from --------------------------------------------------------------------------

def view(latest, *folders, complete=None) -> dict:
    names = [f"step_{n:08d}" for n in folders]
    return dict(latest=latest and f"step_{latest:08d}", folders=sorted(names, reverse=True),
                complete=sorted(names if complete is None else [f"step_{n:08d}" for n in complete], reverse=True))


HOSTS = ["node0", "node0", "node1", "node1"]


def test_every_rank_seeing_the_same_resumes_from_latest_without_a_word():
    paths, note = agree.agreed_checkpoints("ck", [view(4, 2, 4)] * 4, HOSTS)
    assert (paths, note) == (["ck/step_00000004", "ck/step_00000002"], None)


@pytest.mark.parametrize("stale", [view(2, 2, 4), view(2, 2), view(4, 2)],
                         ids=["older-latest", "older-latest-newest-missing", "newest-missing"])
def test_a_stale_view_on_one_node_resumes_every_rank_from_the_newest_common_checkpoint(stale):
    """After the wait: the newest checkpoint every rank sees, up to the oldest `latest` any rank reads; one line
    names who sees what. Before, each rank resumed from its own view."""
    paths, note = agree.agreed_checkpoints("ck", [view(4, 2, 4), view(4, 2, 4), stale, stale], HOSTS)
    assert paths == ["ck/step_00000002"]
    assert note.startswith(f"the ranks do not see the same checkpoints after {agree.CHECKPOINT_WAIT_S:g} s "
                           f"(ranks 0-1 (node0) see latest step_00000004 and step_00000004, step_00000002; ranks 2-3 "
                           f"(node1) see latest "), note
    assert note.endswith("resuming from the newest one every rank sees, step_00000002"), note


def test_a_latest_no_rank_sees_is_refused_and_a_checkpoint_only_some_ever_see_is_left_to_a_restart():
    with pytest.raises(OD.CheckpointError, match="names 'step_00000099', which is not a folder") as e:
        agree.agreed_checkpoints("ck", [view(99, 2, 4)] * 4, HOSTS)
    assert T.exit_code(e.value) == 2  # the operator's edit: a restart repeats it
    with pytest.raises(OD.CheckpointError, match="none is seen by every rank; a restart looks again") as e:
        agree.agreed_checkpoints("ck", [view(2, 2)] * 2 + [view(None)] * 2, HOSTS)
    assert e.value.os_errno == errno.ESTALE and T.exit_code(e.value) == 1


def test_a_rank_that_cannot_list_the_checkpoints_stops_every_rank_with_its_error(tmp_path, monkeypatch):
    """Raised on that rank alone, the error would leave the others waiting in the next collective."""
    def denied(root):
        raise PermissionError(errno.EACCES, "Permission denied", root)
    monkeypatch.setattr(checkpoints, "list_checkpoints", denied)
    stale = agree.checkpoint_view(str(tmp_path))
    with pytest.raises(OD.CheckpointError) as e:
        agree.agreed_checkpoints(str(tmp_path), [view(4, 2, 4)] * 3 + [stale], HOSTS)
    assert str(e.value) == f"rank 3 (node1) cannot list the checkpoints: {tmp_path}: Permission denied"
    assert T.exit_code(e.value) == 2  # EACCES lasts (out_dir.LASTING_ERRNOS)


def test_a_gpu_that_cannot_say_its_memory_is_named():
    facts = two_nodes()
    facts[1]["gpu"] = dict(index=1, error="CUDA error: an illegal memory access was encountered")
    assert agree.decide(facts)[0] == ["rank 1 (node0): GPU 1 cannot say its free memory (CUDA error: an illegal memory "
                                      "access was encountered): nvidia-smi -q shows its state; leave the node out "
                                      "(sbatch --exclude=node0)"]


PLANNED = dict(peak_gib=71.25, context_gib=1.25)  # the planner's memory figures for the run: 70 GiB for PyTorch


def held_gpu(monkeypatch, free_gib_by_look: list[float]) -> list[float]:
    """agree.gpu_memory's readings of an 80 GiB GPU whose free memory is the next of `free_gib_by_look` at each
    look (the last one from then on), for a run that needs 70 GiB; no waiting between looks. Returns the times
    it looked."""
    looks = []

    def mem_get_info(device):
        looks.append(agree.time.monotonic())
        return free_gib_by_look[min(len(looks), len(free_gib_by_look)) - 1] * GIB, 80 * GIB
    monkeypatch.setattr(agree.torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(agree.torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(agree.torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(agree, "GPU_RELEASE_POLL_S", 0.01)
    return looks


def test_a_gpu_still_held_by_a_previous_attempt_is_waited_for_and_one_held_past_the_wait_names_its_node(monkeypatch):
    """The exit-code policy (processes.py): a GPU short of free memory because a previous attempt's process is still
    exiting is transient, so it is looked at again until it is given back (the run goes on, no restart spent); one
    still held after GPU_RELEASE_WAIT_S is another job's or a process that cannot exit, refused with exit 2 (as
    every refusal of decide) and a line naming the node to leave out. Before, the first look refused it."""
    device = T.torch.device("cuda", 0)
    looks = held_gpu(monkeypatch, [2.0, 2.0, 75.0])
    gpu = agree.gpu_memory(device, PLANNED)
    assert len(looks) == 3 and gpu == dict(index=0, free=75 * GIB, total=80 * GIB, reserved=0, need=70 * GIB)
    assert agree.decide(two_nodes(gpu=gpu))[0] == []
    monkeypatch.setattr(agree, "GPU_RELEASE_WAIT_S", 0.3)
    looks = held_gpu(monkeypatch, [2.0])
    gpu = agree.gpu_memory(device, PLANNED)
    assert gpu["free"] == 2 * GIB and looks[-1] - looks[0] >= 0.3 and len(looks) > 3
    problems = agree.decide(two_nodes(gpu=gpu))[0]
    assert problems == [f"rank {r} (node1): GPU 0 has 2.0 GiB free of 80.0, and the run needs 70.0 GiB for PyTorch at "
                        f"its peak (--plan's, less the context); 78.0 GiB are held outside this process's allocator, "
                        f"still after 0.3 s: another job's process on the GPU (nvidia-smi names it), or one that cannot "
                        f"exit; leave the node out (sbatch --exclude=node1)" for r in (2, 3)]


def test_a_view_that_catches_up_within_the_wait_resumes_from_the_newest(monkeypatch, capsys):
    """Rank 1 sees step 4 only at its third look: both ranks look as often (rounds, not clocks), and resume from 4."""
    monkeypatch.setattr(agree, "CHECKPOINT_POLL_S", 0.01)
    looks = [0, 0]

    def checkpoint_view(root):
        rank = T.dist.get_rank()
        looks[rank] += 1
        return view(4, 2, 4) if rank == 0 or looks[rank] >= 3 else view(2, 2)
    monkeypatch.setattr(agree, "checkpoint_view", checkpoint_view)
    got = run_ranks(2, lambda rank: agree.resume_candidates("ck", rank, ["a", "b"], T.torch.device("cpu")))
    assert got == [["ck/step_00000004", "ck/step_00000002"]] * 2 and looks == [3, 3]
    assert "warning" not in capsys.readouterr().err


def test_facts_travel_as_json_in_rank_order():
    got = run_ranks(3, lambda rank: OD.gather_json({"rank": rank, "host": "x" * rank}, T.torch.device("cpu")))
    assert got == [[{"rank": r, "host": "x" * r} for r in range(3)]] * 3


def test_a_checkpoint_group_that_cannot_connect_is_one_line_within_the_short_timeout(monkeypatch):
    """gloo connects every pair of ranks when its group is made, for as long as the group's timeout (an hour): a
    group made first with GLOO_CONNECT_TIMEOUT_S says in one line what to set."""
    def new_group(backend, timeout):
        assert timeout.total_seconds() == OD.GLOO_CONNECT_TIMEOUT_S  # the probe comes first
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:144] Timed out connecting to 10.0.0.2:41233")
    monkeypatch.setattr(OD, "group", None)
    monkeypatch.setattr(OD.dist, "new_group", new_group)
    with pytest.raises(RuntimeError) as e:
        OD.make_group(60)
    assert str(e.value).startswith("the checkpoint group (gloo: TCP between every pair of ranks) did not connect within "
                                   "120 s ([../third_party/gloo/gloo/transport/tcp/pair.cc:144] Timed out connecting to "
                                   "10.0.0.2:41233): gloo listens on the address"), e.value
    assert "GLOO_SOCKET_IFNAME" in str(e.value) and OD.group is None


def test_the_probe_group_is_destroyed_only_once_every_rank_has_connected(monkeypatch):
    """A rank that destroys the probe group as soon as its own connections are made leaves a slower rank still
    connecting to it ("Connection closed by peer"): make_group waits on a barrier of the probe first."""
    calls = []
    monkeypatch.setattr(OD, "group", None)
    monkeypatch.setattr(OD.dist, "new_group", lambda backend, timeout: calls.append(("new", timeout.total_seconds()))
                        or f"group {len(calls)}")
    monkeypatch.setattr(OD.dist, "barrier", lambda group: calls.append(("barrier", group)))
    monkeypatch.setattr(OD.dist, "destroy_process_group", lambda group: calls.append(("destroy", group)))
    OD.make_group(60)
    assert calls == [("new", OD.GLOO_CONNECT_TIMEOUT_S), ("barrier", "group 1"), ("destroy", "group 1"), ("new", 3600)]
    assert OD.group == "group 4"


# -- launch.sh's settings, made by train.py ------------------------------------------------------------------

def test_train_py_sets_what_launch_sh_set_and_keeps_what_the_user_exported(tmp_path, monkeypatch):
    """NVLS off (its buffers sit outside the allocator, over the planner's allowance), expandable segments, NCCL's
    flight recorder dumping into OUT_DIR/nccl_trace (a relative --out_dir from the caller's folder; made on GPUs,
    since torch's writer makes no folders), not torch's default /tmp/nccl_trace_rank_N, which sites wipe; the
    deprecated TORCH_NCCL_TRACE_BUFFER_SIZE never set (torch 2.13 warns on every rank)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(agree.torch.cuda, "is_available", lambda: True)
    env = {}
    agree.launch_settings("run_a", env)
    assert env == dict(NCCL_NVLS_ENABLE="0", PYTORCH_ALLOC_CONF="expandable_segments:True", TORCH_FR_BUFFER_SIZE="2000",
                       TORCH_NCCL_DUMP_ON_TIMEOUT="1", TORCH_FR_DUMP_TEMP_FILE=f"{tmp_path}/run_a/nccl_trace/rank_")
    assert (tmp_path / "run_a" / "nccl_trace").is_dir()
    mine = dict(NCCL_NVLS_ENABLE="1", PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:512", TORCH_NCCL_TRACE_BUFFER_SIZE="50",
                TORCH_NCCL_DEBUG_INFO_TEMP_FILE="/scratch/fr_", TORCH_NCCL_DUMP_ON_TIMEOUT="0")
    env = dict(mine)
    agree.launch_settings(str(tmp_path / "run_b"), env)
    assert env == mine and not (tmp_path / "run_b").exists()


# -- Python's garbage collector: at the same step on every rank ----------------------------------------------

def test_garbage_is_collected_at_fixed_steps_and_never_by_itself_while_training(files, tmp_path, monkeypatch,
                                                                                main_in_process):
    """An automatic collection pauses one rank at a moment of its own, and every collective waits for it: off while
    the steps run, a collection before the first and at every GC_EVERY_STEPS-th step, the same steps on every rank;
    what set-up made is frozen out of them (a collection then walks only what training made)."""
    monkeypatch.setattr(T, "GC_EVERY_STEPS", 2)
    collected, enabled_in_step, real_step = [], [], T.train_step
    monkeypatch.setattr(T.gc, "collect", lambda *a: collected.append(T.gc.isenabled()))

    def train_step(cfg, sharded, windows, step, position):
        enabled_in_step.append((step, T.gc.isenabled(), len(collected), T.gc.get_freeze_count() > 0))
        return real_step(cfg, sharded, windows, step, position)
    monkeypatch.setattr(T, "train_step", train_step)
    assert main_in_process(FLAGS[:4] + files + ["--steps=4", "--eval_every=0", f"--out_dir={tmp_path}"]) == 0
    assert enabled_in_step == [(1, False, 1, True), (2, False, 2, True), (3, False, 2, True), (4, False, 3, True)]
    assert T.gc.isenabled() and T.gc.get_freeze_count() == 0  # given back when the run ends


# -- the whole path, two processes ---------------------------------------------------------------------------

FLAGS = ["--seq_len=16", "--batch_size=8", "--micro_batch_size=2", "--dtype=float32", "--steps=6", "--lr=3e-3",
         "--warmup_steps=2", "--seed=4", "--timeout_min=1", "--ckpt_every=2", "--eval_every=0"]


def run_facts(flags, out_dir, rank_facts: dict, **env) -> subprocess.CompletedProcess:
    return run_script(DIST_WORKER, ["facts", str(out_dir), *flags, f"--out_dir={out_dir}"], nproc=2, timeout=240,
                      env=dict(ZERO3_TEST_FACTS=json.dumps(rank_facts), **env))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return model_and_tokens(tmp_path_factory.mktemp("agree"))


def test_what_one_node_sees_differently_is_said_on_every_rank_before_step_1(files, tmp_path):
    """Rank 1 is on 'node1', whose hostname resolves to 127.0.1.1, with another flash-attn and 100 kB of host memory
    for a --async_save true run: every rank exits 2 with the same lines, before any step or weight. Before agree.py,
    rank 1 alone stopped on the host memory, and nothing named the flash-attn or the loopback address."""
    proc = run_facts(FLAGS + files + ["--async_save=true"], tmp_path,
                     {"1": dict(host="node1", netns="another-machine", gloo="127.0.1.1", flash_attn="2.6.3",
                                host_memory=100_000)})
    lines = proc.stderr.splitlines()
    for start in ("error: rank 1 (node1): --async_save true: the 2 rank(s) on this node need",
                  "error: flash-attn differs between ranks: not installed on rank 0 (",
                  "error: rank 1 (node1): the hostname node1 resolves to 127.0.1.1, a loopback address"):
        assert sum(line.startswith(start) for line in lines) == 2, (start, proc.stderr[-3000:])  # each rank's
    assert "step 1" not in proc.stdout and "resumed" not in proc.stdout
    assert proc.first_failure["exit_code"] == 2  # the refusal's code, as torchrun's summary would show it


def test_a_rank_with_a_stale_view_of_the_out_dir_resumes_with_the_others_and_the_settings_are_launch_shs(files, tmp_path):
    """The out_dir holds steps 2 and 4 (`latest`: 4), but rank 1 sees it as it was before step 4's save: an older
    `latest`, and no step 4. Both ranks resume from step 2, one line says why, and steps 3-6 have the losses of a
    run never stopped. Before agree.py, rank 0 resumed from step 4 and rank 1 from step 2: a run of mixed steps,
    which hung. The run is a plain torchrun of the worker: train.py set launch.sh's GPU settings itself, and kept
    the one the user exported."""
    whole = tmp_path / "whole"
    run_train(FLAGS + files + [f"--out_dir={whole}"], nproc=2)
    out = stopped_at(whole, tmp_path / "resumed", 4)
    shutil.copytree(whole / "checkpoints" / "step_00000002", out / "checkpoints" / "step_00000002")
    proc = run_facts(FLAGS + files, out, {"1": {"checkpoints_up_to": "step_00000002"}}, NCCL_NVLS_ENABLE="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1 (" in proc.stderr and "resuming from the newest one every rank sees, step_00000002" in proc.stderr
    assert "resumed from" in proc.stdout and "at step 2" in proc.stdout
    losses = {m["step"]: m["loss"] for m in read_metrics(out)}
    assert [losses[s] for s in range(3, 7)] == [m["loss"] for m in read_metrics(whole)][2:]
    for row in read_metrics(out)[2:]:  # every rank's own compute time gathered: the slowest named beside the median
        assert row["slowest_rank"] in (0, 1) and row["slowest_host"] and row["compute_max_s"] >= row["compute_median_s"]
    assert " | slowest rank " in proc.stdout
    for rank in (0, 1):
        env = json.loads((out / f"env_rank{rank}.json").read_text())
        assert env == dict(NCCL_NVLS_ENABLE="1", PYTORCH_ALLOC_CONF="expandable_segments:True", TORCH_FR_BUFFER_SIZE="2000",
                           TORCH_NCCL_DUMP_ON_TIMEOUT="1", TORCH_FR_DUMP_TEMP_FILE=f"{out}/nccl_trace/rank_")


# -- start-up's facts before NCCL; the first contact under a deadline; the load waited for (issue 51) -----------

def test_decides_refusals_reach_every_rank_before_a_process_group_that_cannot_form(files, tmp_path):
    """Two GPU nodes (as their facts say), node1's locked-memory limit 64 KiB, and a process group whose creation
    fails as NCCL's does when ibv_reg_mr cannot lock its buffers. The facts travel over the rendezvous store, so
    decide's refusal is every rank's line, exit 2, and the process group is never tried. Before, the group was made
    first: its error (exit 1, restarted into the same failure) was all anyone saw, and the memlock line never came."""
    nccl = "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error\nLast error:\nCall to ibv_reg_mr failed"
    node = lambda host, **more: dict(host=host, netns=host, gloo=None,  # noqa: E731  (CAP_IPC_LOCK would lift the limit)
                                     read={"nccl": "2.21.5", "ipc_lock": False},
                                     init_fails=nccl, **more)
    proc = run_facts(FLAGS + files, tmp_path, {"0": node("node0", memlock=-1), "1": node("node1", memlock=64 * 1024)})
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    memlock = ("error: rank 1 (node1): the locked-memory limit is 0.0625 MiB (ulimit -l) and the process lacks "
               "CAP_IPC_LOCK: NCCL cannot register")
    assert len(lines) == 2 and all(line.startswith(memlock) for line in lines), proc.stderr[-3000:]
    assert "ibv_reg_mr" not in proc.stderr and proc.first_failure["exit_code"] == 2


def test_a_rank_that_never_reaches_the_first_contact_is_named_by_every_other_rank_within_the_deadline(files, tmp_path):
    """Rank 2 of 3 reaches the process group's first contact 120 s late (as a rank hung in its set-up would). The
    others, past --first_contact_s 8, each print one line naming it and what to check, and exit 2, long before
    --timeout_min's minute: a restart would hang the same way. Before, they waited for --timeout_min (exit 1, and
    torchrun restarted into the same hang)."""
    t0 = time.monotonic()
    proc = run_train(FLAGS + files + [f"--out_dir={tmp_path}", "--first_contact_s=8", "--batch_size=6"], nproc=3, check=False,
                     env={"ZERO3_FAULT": "late_contact:2:120"}, timeout=200)
    elapsed_s = time.monotonic() - t0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    host = agree.host_name()
    assert sorted(line.split(":")[1] for line in lines) == [f" rank 0 ({host})", f" rank 1 ({host})"], proc.stderr[-3000:]
    for line in lines:
        assert line.endswith(f"the process group's first contact (gloo: init_process_group and one all-reduce) did not "
                             f"complete within --first_contact_s 8: rank 2 ({host}) never reached it (hung or slow before "
                             f"it: its own output says where); check GLOO_SOCKET_IFNAME (the interface between the "
                             f"nodes) and the firewall between them. A restart would hang the same way"), line
    assert proc.first_failure["exit_code"] == 2 and proc.first_failure["rank"] in (0, 1)
    assert elapsed_s < 50, elapsed_s  # 8 s, the set-up before it, and the agent's stop of rank 2; not 60 s nor 120


def test_the_nccl_first_contact_line_names_what_to_check():
    cfg = T.parse_args(["--out_dir=/shared/run"])
    line = T.processes.first_contact_line(cfg, "nccl", 3, ["node0"] * 8 + ["node1"] * 8, [])
    assert line.startswith("rank 3 (node0): the process group's first contact (nccl: init_process_group and one "
                           "all-reduce) did not complete within --first_contact_s 180: every rank reached it, so the "
                           "ranks could not connect; check the interface NCCL chose"), line
    for what in ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "PCIe ACS", "GPUDirect", "NCCL_DEBUG=INFO", "/shared/run/nccl_trace",
                 "A restart would hang the same way"):
        assert what in line, what


def test_a_rank_that_loads_slowly_is_waited_for_past_the_step_timeout_and_named(files, tmp_path):
    """Rank 1 reads --init_from 15 s longer than rank 0; --timeout_min is 6 s. Every rank waits for the others'
    weights on the checkpoint group (--ckpt_timeout_min), so the run trains, and rank 0 names the slow rank with
    its seconds beside the median's. Before, rank 0 went on to its next collective and timed out after 6 s."""
    flags = [f for f in FLAGS if not f.startswith("--timeout_min")] + ["--timeout_min=0.1", "--steps=2",
                                                                        "--ckpt_every=0"]
    proc = run_facts(flags + files, tmp_path, {"1": {"slow_load_s": 15}})
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = [line for line in proc.stderr.splitlines() if "read its weights" in line]
    assert line.startswith(f"warning: rank 1 ({agree.host_name()}) read its weights in 1"), line
    assert line.endswith("the others waited for it (--ckpt_timeout_min); its node's disk or filesystem mount is "
                         "worth a look"), line
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2]


def test_the_slowest_load_is_named_only_well_past_the_median(monkeypatch):
    """Over LOAD_NOTE_FACTOR x the other ranks' median and LOAD_NOTE_LEAST_S past it: named; a spread of a few
    seconds is not."""
    def loads(seconds):
        def all_gather_flat(out, mine, group):
            out.copy_(T.torch.tensor(seconds, dtype=T.torch.float64))
        monkeypatch.setattr(agree.OD, "all_gather_flat", all_gather_flat)
        return agree.loads_waited(agree.time.perf_counter(), 0, ["node0", "node0", "node1", "node1"])
    assert loads([10.0, 11.0, 12.0, 19.0]) is None  # not twice the median
    assert loads([1.0, 1.2, 1.1, 4.0]) is None  # twice, but 3 s: noise at this scale
    assert loads([10.0, 11.0, 12.0, 40.0]).startswith("rank 3 (node1) read its weights in 40.0 s, the other ranks' median "
                                                      "11.0 s")


# -- before step 1: the plan's assumptions measured (issue: the plan's assumptions measured) -------------------

H100 = "NVIDIA H100 80GB HBM3"


def test_a_fabric_under_half_the_plans_bus_bandwidth_is_a_warning_naming_what_to_check():
    assert agree.fabric_warning(200.0, 360.0, "the all-gather of layers.0") is None  # above half: the plan holds
    assert agree.fabric_warning(0.3, None, "the all-gather of head") is None  # a CPU, a GPU the planner does not know
    line = agree.fabric_warning(40.0, 360.0, "the all-gather of layers.0 over 16 ranks")
    assert line.startswith("the all-gather of layers.0 over 16 ranks ran at 40.0 GB/s bus bandwidth, under 50% of the "
                           "plan's 360 (--nics_per_node x --nic_gbps, capped by NVLink): NCCL may be on TCP sockets")
    assert "NCCL_DEBUG=INFO" in line and "NET/IB" in line and "GDRDMA" in line and "NCCL_IB_HCA" in line


def test_a_gpu_that_cannot_hold_the_planned_peak_beside_what_it_holds_outside_the_allocator_is_named():
    gib = 2**30
    lines = agree.outside_allocator_problems([1.3 * gib, 2.5 * gib], [79.65 * gib, 79.65 * gib], 77.5 * gib,
                                             ["node0", "node1"], "block recompute")
    assert lines == ["rank 1 (node1): the planned peak, 77.50 GiB in PyTorch's allocator (block recompute), beside the "
                     "2.50 GiB its GPU holds outside it (CUDA context, NCCL, other processes: measured after set-up), "
                     "needs 80.00 GiB of its 79.65"]


def test_a_planner_that_cannot_answer_is_not_read_as_no_configuration_fitting():
    """The nearest fit is the planner's, asked in a subprocess: a planner that failed (its warning says why) is not
    'no configuration fits', which would send the user looking for a configuration that does not exist."""
    assert agree.nearest_fit_words(None, 2.5) == ("; the planner could not name a configuration that fits at that "
                                                  "figure (its warning says why)")
    assert agree.nearest_fit_words({"nearest_fit": None}, 2.5) == "; no configuration --plan tries fits at that figure"
    assert agree.nearest_fit_words({"nearest_fit": "--micro_batch_size 1"}, 2.5) == (
        "; the nearest configuration that fits at --outside_gib 2.50: --micro_batch_size 1 (--plan with it prints the rest)")


def test_before_step_1_the_fabric_and_the_memory_outside_the_allocator_are_measured_and_a_peak_that_cannot_fit_stops_every_rank(
        files, tmp_path):
    """Both ranks' GPUs are H100s as agree.gpu_now reads them; rank 1's holds its whole memory outside PyTorch's
    allocator (all of it). Rank 0 prints the all-gather's bus bandwidth beside the plan's (NVLink: one node), warns that this
    CPU's is under half of it, and prints the largest figure outside the allocator beside --outside_gib; then every
    rank exits 2 with rank 1's line, before step 1. Before this, the run trained into an out-of-memory error."""
    total = 81559 * 2**20
    gpu = lambda outside: {"gpu_now": dict(name=H100, outside=outside, total=total)}  # noqa: E731
    proc = run_facts(FLAGS + files, tmp_path, {"0": gpu(1.1 * 2**30), "1": gpu(total)})
    assert " over 2 ranks: " in proc.stdout and "GB/s bus bandwidth (measured at start-up), the plan's 360" in proc.stdout
    assert " over 2 ranks ran at " in proc.stderr and "NET/Socket" in proc.stderr, proc.stderr[-3000:]
    assert ("GPU memory outside PyTorch's allocator after set-up (CUDA context, NCCL): largest 79.65 GiB (rank 1 ("
            in proc.stdout) and "the plan allows 1.25 (--outside_gib)" in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: rank 1 (")]
    assert len(lines) == 2 and lines[0] == lines[1], proc.stderr[-3000:]  # said on each rank
    assert "its GPU holds outside it (CUDA context, NCCL, other processes: measured after set-up), needs " in lines[0]
    assert lines[0].endswith("; no configuration --plan tries fits at that figure"), lines[0]
    assert "step 1" not in proc.stdout and proc.first_failure["exit_code"] == 2
