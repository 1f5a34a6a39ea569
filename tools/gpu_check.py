"""Each GPU's health in seconds: a check matmul whose exact result any correct device computes (a wrong one is told
from it, not from other GPUs), its time, uncorrectable ECC errors and the row remapper's state (nvidia-smi), and
whether the CUDA allocator runs with the expandable segments the environment asks for.

    python tools/gpu_check.py                          # every visible GPU, one line each
    python tools/gpu_check.py --device cuda:3          # one GPU; --device cpu: the check matmul on this CPU
    python tools/gpu_check.py --device cuda:3 --json   # the facts as JSON (what a run reads), exit 0 whatever they say

By hand, a pre-flight for a node, like `dcgmi diag -r 1` but seconds (and far less thorough): exit 1 when a device
computes wrongly, reports uncorrectable ECC errors or a row remapping pending or failed, cannot run the check (a CUDA
error), or no GPU is visible.
A run (train.py) runs it before step 1 on each rank's own GPU, with --json, in a subprocess (agree.read_health):
a tool, above the trainer, which never imports it. Every rank's facts are then decided together
(agree.decide_health: a GPU much slower than the ranks' median is named too). On a CPU the run skips it: there is
no GPU to check, and a python and torch start per rank would cost the tests' CPU runs minutes (ZERO3_GPU_CHECK_ON_CPU=1
runs it there too: the tests do, to run the subprocess path). docs/operations.md, "What every rank agrees on".
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

import torch

if __name__ == "__main__":  # run as a script: the repository's modules, as from its root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from components import flags, metrics  # noqa: E402
from components.agree import ALLOC_CONF_NAMES  # noqa: E402

HEALTH_MATMUL_N = dict(cuda=8192, cpu=384)  # about 20 ms on an H100 in TF32/fp32; a few ms on a CPU core
HEALTH_REPEATS = 5  # timed, after one to warm up; the fastest counts (interference only ever adds time)


def exact_matmul_inputs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two n x n matrices of integers in [-8, 8], the same on every rank (a seeded CPU generator). Their product's
    entries are integers under 2^24, which fp32 (and TF32's 10-bit mantissa for the inputs) holds exactly in any
    summation order: a correct GPU's result is exact, so a wrong one is told from it, not from the other ranks."""
    generator = torch.Generator().manual_seed(0)
    return (torch.randint(-8, 9, (n, n), generator=generator), torch.randint(-8, 9, (n, n), generator=generator))


def timed_matmul(a, b, device, rank: int) -> tuple[torch.Tensor, float]:
    """(a @ b, its milliseconds): CUDA events on a GPU; on a CPU this thread's CPU time, which a loaded machine
    does not inflate as it does wall time."""
    hook = flags.fault_hook  # tests only (tests/faults.py): this rank's matmul slowed, or its result made wrong
    start = metrics.compute_clock(device)  # the step line's own-compute clock
    product = a @ b
    hook and hook("matmul", 0, rank, product)
    return product, metrics.compute_seconds(start, device) * 1e3


def check_matmul(device, rank: int) -> dict:
    """The device's check matmul: the fastest of HEALTH_REPEATS (ms), and whether its row and column sums equal the
    exact ones (computed in int64 on the CPU: A (B 1) and (1 A) B, n^2 each, not another n^3 matmul)."""
    n = HEALTH_MATMUL_N["cuda" if device.type == "cuda" else "cpu"]
    a, b = exact_matmul_inputs(n)
    on_device = a.to(device, torch.float32), b.to(device, torch.float32)
    times_ms = []
    for _ in range(1 + HEALTH_REPEATS):
        product, ms = timed_matmul(*on_device, device, rank)
        times_ms.append(ms)
    rows, cols = product.double().sum(1).cpu(), product.double().sum(0).cpu()
    right = torch.equal(rows, (a @ b.sum(1)).double()) and torch.equal(cols, (a.sum(0) @ b).double())
    return dict(n=n, matmul_ms=min(times_ms[1:]), wrong=not right)


def ecc_state(report: str) -> dict:
    """From `nvidia-smi -q -d ECC,ROW_REMAPPER` (one GPU): uncorrectable ECC errors since the driver loaded
    (Volatile: "DRAM Uncorrectable", "SRAM Uncorrectable" on H100; "Double Bit ... Total" on older drivers), and the
    row remapper's state (A100 and later: a remap pending until the GPU is reset, a remap that failed). Unknown lines
    and N/A values are skipped: what the driver does not report is no fact."""
    state = dict(volatile_uncorrectable=0, remap_pending=False, remap_failed=False)
    section = sub = ""
    for line in report.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if not value:  # a heading: Volatile, Aggregate, Double Bit, Remapped Rows, ...
            section = key.lower() if key.lower() in ("volatile", "aggregate", "remapped rows") else section
            sub = key.lower()
            continue
        if section == "volatile" and value.isdigit() and ("uncorrectable" in key.lower()
                                                           or sub == "double bit" and key == "Total"):
            state["volatile_uncorrectable"] += int(value)
        if section == "remapped rows" and key == "Pending":
            state["remap_pending"] = value.lower() == "yes"
        if section == "remapped rows" and key == "Remapping Failure Occurred":
            state["remap_failed"] = value.lower() == "yes"
    return state


def gpu_ecc(device) -> dict | None:
    """ecc_state of this GPU (named by its UUID: CUDA_VISIBLE_DEVICES renumbers GPUs, nvidia-smi does not); None on
    a CPU or without nvidia-smi."""
    if device.type != "cuda" or not shutil.which("nvidia-smi"):
        return None
    try:
        uuid = f"GPU-{torch.cuda.get_device_properties(device).uuid}"
        report = subprocess.run(["nvidia-smi", "-q", "-d", "ECC,ROW_REMAPPER", "-i", uuid], capture_output=True,
                                text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError, AttributeError, RuntimeError):
        return None
    return ecc_state(report)


def alloc_conf_warning(env, settings: dict | None, torch_version: str) -> str | None:
    """A warning when the allocator setting asks for expandable segments and the CUDA allocator runs without them
    (`settings`: its allocator_settings as read back; None where it cannot be read: no warning)."""
    asked = [name for name in ALLOC_CONF_NAMES if "expandable_segments:true" in env.get(name, "").replace(" ", "").lower()]
    if not asked or settings is None or settings.get("expandable_segments"):
        return None
    return (f"{' and '.join(asked)} asks for expandable_segments:True, but torch {torch_version}'s CUDA allocator runs "
            f"without it (read back from torch.cuda.memory._snapshot()): freed gathered units can strand reserved "
            f"memory, and the plan's peak assumes they do not. Some torch versions read only one of the names "
            f"(pytorch/pytorch#183387: 2.9 ignores PYTORCH_ALLOC_CONF's expandable_segments); export both, or check "
            f"that the driver supports CUDA's virtual memory management (expandable segments need it)")


def allocator_settings(device) -> dict | None:
    """What the CUDA caching allocator runs with, read back after CUDA started (in this process, with the run's
    environment: the run's own allocator reads the same variables); None on a CPU or where this torch does not
    report it."""
    if device.type != "cuda":
        return None
    try:
        return torch.cuda.memory._snapshot(device).get("allocator_settings")
    except (AttributeError, RuntimeError, TypeError):
        return None


def device_facts(device, rank: int) -> dict:
    """What a run's rank says of its device before step 1 (agree.decide_health reads it): the check matmul, ECC and
    row remapping, the allocator setting in effect (a warning when not), what is wrong (device_problems). `rank`: the fault hook's (tests/faults.py)."""
    cuda = device.type == "cuda"
    matmul = check_matmul(device, rank)  # CUDA starts here: the allocator's settings are read after it
    note = alloc_conf_warning(os.environ, allocator_settings(device), torch.__version__)
    facts = dict(what=f"GPU {device.index}" if cuda else "CPU", name=torch.cuda.get_device_name(device) if cuda else None,
                 **matmul, ecc=gpu_ecc(device), warnings=[note] if note else [])
    return dict(facts, problems=device_problems(facts))


def device_problems(facts: dict) -> list[list[str]]:
    """Why the device is not to run on, as [what is wrong, what to do besides leaving its node out] each: a wrong
    result, uncorrectable ECC errors, a row remapping pending or failed. A run names the rank and the node to leave
    out before them (agree.decide_health)."""
    ecc, what, n = facts["ecc"] or {}, facts["what"], facts["n"]
    problems = [[f"{what}'s check matmul ({n} x {n}, exact integers) gave a wrong result: the device computes wrongly",
                 "have it tested (dcgmi diag)"]] if facts["wrong"] else []
    if ecc.get("volatile_uncorrectable"):
        problems.append([f"{what} reports {ecc['volatile_uncorrectable']} uncorrectable ECC error(s) since the driver "
                         f"loaded (nvidia-smi -q -d ECC): it will crash this run as it did the last", "reset the GPU"])
    if ecc.get("remap_pending") or ecc.get("remap_failed"):
        state = "a row remapping failed" if ecc.get("remap_failed") else "a row remapping is pending until a reset"
        problems.append([f"{what}: {state} (nvidia-smi -q -d ROW_REMAPPER)", "reset the GPU (a failed remapping: "
                                                                              "replace it)"])
    return problems


def unhealthy(facts: dict) -> bool:
    """A device not to run on (device_problems)."""
    return bool(device_problems(facts))


def device_line(facts: dict) -> str:
    """One line for a device, 'error: ' first when it is unhealthy."""
    ecc = facts["ecc"]
    if ecc is None:
        ecc_words = "ECC and row remapping not read (no nvidia-smi, or a CPU)"
    else:
        remap = ("a row remapping failed: replace the GPU" if ecc["remap_failed"] else
                 "a row remapping pending until a reset" if ecc["remap_pending"] else "no row remapping pending or failed")
        ecc_words = f"{ecc['volatile_uncorrectable']} uncorrectable ECC error(s) since the driver loaded, {remap}"
    result = ("WRONG: the device computes wrongly, have it tested (dcgmi diag)" if facts["wrong"] else "exact")
    name = f" ({facts['name']})" if facts["name"] else ""
    return (f"{'error: ' if unhealthy(facts) else ''}{facts['what']}{name}: check matmul {facts['n']} x {facts['n']} "
            f"{result}, {facts['matmul_ms']:.2f} ms (fastest of {HEALTH_REPEATS}); {ecc_words}")


def parse_devices(value: str | None) -> list[torch.device]:
    """--device's device, or every visible GPU. None visible is exit 1 (a GPU node without its GPUs fails its
    pre-flight); a --device that names no device here is exit 2; one line each."""
    if value is None:
        if not torch.cuda.is_available():
            sys.exit("error: no GPU visible (torch.cuda.device_count() is 0); --device cpu checks this CPU")
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    try:
        device = torch.device(value)
    except RuntimeError:
        device = torch.device("meta")  # not a device: refused below
    if device.type == "cpu":
        return [device]
    if device.type != "cuda" or (device.index or 0) >= torch.cuda.device_count():
        print(f"error: --device {value!r} is not cpu or one of the {torch.cuda.device_count()} GPU(s) visible "
              f"(cuda:N)", file=sys.stderr)
        sys.exit(2)
    return [torch.device("cuda", device.index or 0)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", help="cuda:N or cpu (default: every visible GPU)")
    parser.add_argument("--json", action="store_true", help="print the facts as a JSON list, one object per "
                        "device, and exit 0 whatever they say (a run's rank decides: agree.decide_health)")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))  # the run's rank whose device this is (torchrun's), for the tests' faults
    devices = parse_devices(args.device)
    if args.json:  # a failure is a traceback and a non-zero exit: the run warns and goes on (agree.device_health)
        print(json.dumps([device_facts(device, rank) for device in devices]))
        return 0
    failed = False
    for device in devices:
        try:
            facts = device_facts(device, rank)
        except RuntimeError as e:  # a CUDA error: the device cannot even run the check
            print(f"error: {device}: the check could not run ({next(iter(str(e).splitlines()), type(e).__name__)})",
                  flush=True)
            failed = True
            continue
        print(device_line(facts), flush=True)
        for note in facts["warnings"]:
            print(f"warning: {note}", file=sys.stderr, flush=True)
        failed = failed or unhealthy(facts)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
