"""Helpers shared by the tests: small configs, Hugging Face reference models, running train.py."""
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIST_WORKER = os.path.join(ROOT, "tests", "dist_worker.py")  # train.py's pieces under a test's own loop (run_script)
sys.path.insert(0, ROOT)

from components import hf  # noqa: E402
import model as M  # noqa: E402
from warm_start import free_port  # noqa: E402,F401  (a port nothing listens on: the tests' launcher's own)

# The tests inject faults (ZERO3_FAULT, tests/faults.py) into train.py through tests/fault_site/sitecustomize.py, which
# python imports at start-up from PYTHONPATH: every process the tests start inherits it from here.
FAULT_SITE = os.path.join(ROOT, "tests", "fault_site")
if FAULT_SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [FAULT_SITE, os.environ.get("PYTHONPATH")]))


def small_config(**overrides) -> M.ModelConfig:
    """A model small enough for CPU tests that still exercises GQA, several blocks and RoPE."""
    base = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, norm_eps=1e-5,
                rope_theta=10000.0, max_seq_len=64, bos_id=1, eos_id=2)
    base.update(overrides)
    return M.ModelConfig(**base)


def hf_model(cfg: M.ModelConfig, seed: int = 0, hf_config: dict | None = None):
    """transformers' class for cfg's family (LlamaForCausalLM, Qwen3ForCausalLM: model.FAMILIES) with random
    weights, in float32."""
    import transformers
    family = M.FAMILIES[cfg.family]
    torch.manual_seed(seed)
    hf_cfg = getattr(transformers, family["hf_config_class"])(**(hf_config or hf.config_to_hf(cfg, torch.float32)))
    hf_cfg._attn_implementation = "eager"
    ref = getattr(transformers, family["hf_class"])(hf_cfg).float().eval()
    with torch.no_grad():  # norms start at ones; make them random so a wrong norm weight shows
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return ref


def ours_from_hf(cfg: M.ModelConfig, ref) -> M.Llama:
    """Our model with `ref`'s weights, read as the trainer reads a Hugging Face folder: the files save_pretrained
    writes, held to exactly our parameters (hf.check_hf_tensors), each under M.hf_name of its name. Not
    ref.state_dict(): transformers 5 renames some tensors in memory (each Mixtral layer's experts fused in one)."""
    from safetensors.torch import load_file
    ours = M.Llama(cfg).float()
    with tempfile.TemporaryDirectory(prefix="zero3_hf_") as folder:
        files = hf.hf_file_of_tensors(save_hf(ref, folder))
        hf.check_hf_tensors(files, cfg, folder)
        on_disk = {name: t for path in set(files.values()) for name, t in load_file(path).items()}
    ours.load_state_dict({name: on_disk[M.hf_name(name)] for name, _ in ours.named_parameters()}, strict=True)
    return ours


def stand_in_unit(name: str, numel: int = 6, rank: int = 0, world: int = 1, **fields):
    """A test's stand-in for one of train.py's units with every field components/checkpoints.py's interface lists and
    components/hf.py reads (test_test_helpers holds it to them): this rank's shard of `numel` elements (padded to
    a multiple of `world`), one 1-D parameter `NAME.weight`, zero master weights and AdamW moments; `fields` replace
    any of them."""
    from types import SimpleNamespace
    padded = -(-numel // world) * world
    shard = padded // world
    return SimpleNamespace(**{**dict(
        name=name, numel=numel, padded_numel=padded, shard_numel=shard, shard_start=shard * rank,
        slots=[SimpleNamespace(name=f"{name}.weight", shape=(numel,), offset=0)], master_shard=torch.zeros(shard),
        gathered=torch.zeros(padded), optimizer_state={key: torch.zeros(shard) for key in M.OPTIMIZER_STATE},
        trained=True, optimizer_steps=1), **fields})


def learnable_tokens(path: str, vocab_size: int, n: int = 4000, seed: int = 0, eos_id: int | None = None) -> str:
    """A .npy token file a small model learns quickly (a walk through the vocabulary with random steps
    of 1-3), so a few steps move the loss enough for comparisons to mean something. The walk passes any one id
    every ~vocab_size tokens; with `eos_id`, a document also ends every 24-72 tokens whatever the vocabulary,
    so windows pack several documents (--doc_mask's oracle) for a fork's larger vocabulary too."""
    rng = np.random.default_rng(seed)
    tokens = np.cumsum(rng.integers(1, 4, size=n)) % vocab_size
    if eos_id is not None:
        ends = np.cumsum(rng.integers(24, 73, size=n // 24))
        tokens[ends[ends < n]] = eos_id
    np.save(path, tokens.astype(np.uint16))
    return path


def save_hf(ref, path: str):
    ref.save_pretrained(path, safe_serialization=True)
    return path


def flag_value(args: list[str], name: str) -> str | None:
    """--NAME's value in a train.py command line (`--name=value` or `--name value`), or None."""
    for i, arg in enumerate(args):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(args):
            return args[i + 1]
    return None


SAMPLE = []  # the built-in sample, built once per test session


def with_built_sample(args: list[str]):
    """A run of the built-in sample (--data sample, the default) finds it in OUT_DIR/sample as its first build
    leaves it, copied from one built once per session with the folder's name in its meta.json files respelled:
    the same token ids and tokenizer as a build there (whose tokenizer.model would name its own folder), without
    the ~5 s each build takes (tools/sample_corpus.py, whose own tests build it)."""
    out_dir = flag_value(args, "out_dir")
    if out_dir is None or flag_value(args, "data") not in (None, "sample"):
        return
    target = os.path.join(os.path.abspath(os.path.join(ROOT, out_dir)), "sample")
    if os.path.exists(target):
        return
    if not SAMPLE:
        from tools import sample_corpus
        SAMPLE.append(sample_corpus.build_sample(os.path.join(tempfile.mkdtemp(prefix="zero3_sample_"), "sample")))
    try:
        shutil.copytree(SAMPLE[0], target)
    except OSError:  # an --out_dir a test makes unusable on purpose (a file, read-only): the run says what is wrong
        return
    for folder, _, files in os.walk(target):
        if "meta.json" in files:
            path = os.path.join(folder, "meta.json")
            with open(path) as f:
                text = f.read()
            with open(path, "w") as f:
                f.write(text.replace(json.dumps(SAMPLE[0])[1:-1], json.dumps(target)[1:-1]))


WARM = []  # the session's warm_start process, started by the first run_script
WARM_LOCK = threading.Lock()


def init_processes(cfg):
    """Returns (rank, world, device): the device, the ranks met and the group made as train.setup makes them, with no
    facts agreed between (setup agrees them in between; a test that wants just the group)."""
    from components import agree, processes
    device = processes.pick_device(cfg)
    store, rank, world = processes.rendezvous(cfg)
    processes.make_group(cfg, store, rank, world, device, [agree.host_name()] * world)
    return rank, world, device


def run_train(args: list[str], nproc: int = 1, env: dict | None = None, timeout: int = 600, check=True):
    """Runs train.py at `nproc` ranks (gloo, CPU) as run_script does and returns its CompletedProcess. One rank is
    plain `python train.py` (a one-process group, as init_processes makes it)."""
    with_built_sample(args)
    proc = run_script(os.path.join(ROOT, "train.py"), args, nproc, env, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_script(script: str, args: list[str], nproc: int = 1, env: dict | None = None, timeout: int = 600):
    """`python script *args`, or `torchrun --standalone --nproc_per_node=nproc script *args` when nproc > 1, with
    OMP_NUM_THREADS=1 and `env`, from the repository: its CompletedProcess, with `first_failure` ({"rank",
    "exit_code"}: what torchrun's summary calls the root cause) when a rank failed; TimeoutExpired past `timeout`.
    Its processes are forked from a python that has imported train.py's modules once (tests/warm_start.py): the
    ~3 s of imports each python start-up spends is most of a small run. Real torchrun and launch.sh are what
    test_launch, test_faults and the SLURM tier start."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, script, *args]
    with tempfile.TemporaryDirectory(prefix="zero3_run_") as folder:
        files = {name: os.path.join(folder, name) for name in ("stdout", "stderr", "report")}
        returncode = warm_run(dict(script=script, args=args, nproc=nproc, env=full_env, cwd=ROOT, **files), timeout)
        with open(files["stdout"]) as out, open(files["stderr"]) as err:
            proc = subprocess.CompletedProcess(cmd, returncode, out.read(), err.read())
        proc.first_failure = None
        if os.path.exists(files["report"]):
            with open(files["report"]) as f:
                proc.first_failure = json.load(f)
    if returncode is None:
        raise subprocess.TimeoutExpired(cmd, timeout, proc.stdout, proc.stderr)
    return proc


def warm_run(request: dict, timeout: float) -> int | None:
    """One run in the warm process: its exit code, or None when it ran past `timeout` (its processes killed). One
    run at a time: a second thread's run waits for the first to end."""
    with WARM_LOCK:
        if not WARM or WARM[0].poll() is not None:
            WARM[:] = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "warm_start.py")], text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT,
                                        env=dict(os.environ, OMP_NUM_THREADS="1"))]
        WARM[0].stdin.write(json.dumps(dict(request, timeout=timeout)) + "\n")
        WARM[0].stdin.flush()
        reply = WARM[0].stdout.readline()
    if not reply:
        raise RuntimeError(f"tests/warm_start.py ended (exit code {WARM[0].wait()}) before {request['script']} did")
    return json.loads(reply)["returncode"]


def read_metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def stopped_at(out, into, step: int):
    """An --out_dir as a run stopped after `step` leaves it: `out`'s step-`step` checkpoint, named by `latest`,
    with the frozen set it names (--freeze), and `out`'s metrics.jsonl lines up to that step (the same command
    resumes from there). Returns `into`."""
    name = f"step_{step:08d}"
    shutil.copytree(os.path.join(out, "checkpoints", name), os.path.join(into, "checkpoints", name))
    with open(os.path.join(out, "checkpoints", name, "manifest.json")) as f:
        frozen = json.load(f).get("frozen")
    if frozen:
        shutil.copytree(os.path.join(out, "checkpoints", frozen["folder"]),
                        os.path.join(into, "checkpoints", frozen["folder"]))
    with open(os.path.join(into, "checkpoints", "latest"), "w") as f:
        f.write(name + "\n")
    with open(os.path.join(out, "metrics.jsonl")) as f, open(os.path.join(into, "metrics.jsonl"), "w") as kept:
        kept.writelines(line for line in f if json.loads(line)["step"] <= step)
    return into


def model_and_tokens(root) -> list[str]:
    """--init_from and --data for the fault, launch, out_dir and offload tests: a seeded small HF model and
    learnable tokens, written into the folder `root`."""
    cfg = small_config()
    init = save_hf(hf_model(cfg, seed=3), os.path.join(root, "init"))
    data = learnable_tokens(os.path.join(root, "tok.npy"), cfg.vocab_size, n=3000)
    return [f"--init_from={init}", f"--data={data}"]


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage reachable by the garbage collector."""
    seen, total = set(), 0
    warnings.simplefilter("ignore", FutureWarning)  # isinstance() pokes deprecated torch attributes
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.device.type == "meta":
                continue
        except ReferenceError:  # a weakref.proxy whose object is gone (another test's)
            continue
        storage = obj.untyped_storage()
        try:
            ptr = storage.data_ptr()
        except RuntimeError:  # a fake tensor (tests/fake_cuda.py's, still referenced somewhere): no memory
            continue
        if storage.nbytes() and ptr not in seen:
            seen.add(ptr)
            total += storage.nbytes()
    return total


def planner_assumptions() -> dict[str, dict[str, list[str]]]:
    """docs/planning.md's tables of what the planner assumes, by the first word of their header ("constant",
    "GPU", "model"): each row's cells after its name, by the name."""
    with open(os.path.join(ROOT, "docs", "planning.md")) as f:
        section = f.read().split("## What the planner assumes, and from where", 1)[1]
    tables = {}
    for block in section.split("\n\n"):
        lines = block.strip().splitlines()
        if lines and lines[0].startswith("| "):
            rows = [line.strip("| ").split(" | ") for line in lines[2:]]
            tables[lines[0].strip("| ").split()[0]] = {row[0].strip("`"): row[1:] for row in rows}
    return tables
