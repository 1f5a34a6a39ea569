"""Run under torchrun by the tests: checks that need the trainer's internals, one JSON file per rank.

    torchrun --nproc_per_node W tests/dist_worker.py MODE OUT_DIR [train.py flags...]
MODE is `load` (how much of the checkpoint each rank reads), `sgd` (a whole run with SGD + momentum
swapped in for AdamW; writes no JSON), `zloss` (a whole run with a z-loss term added where docs/forking.md
says, and TensorBoard's writer replaced by one that writes OUT_DIR/tensorboard.jsonl), `two_units` (a whole
run of a fork that shards each block as two units: two_units_per_block), `lora` (a whole run of a fork that adds
an adapter unit to each block: LoraBlock), `dora` (the same with DoRA on q_proj and v_proj: DoraBlock), or `facts`
(a whole run in which each rank sees its own machine as ZERO3_TEST_FACTS says: see facts(); writes the launch settings
it ran under). Checks of the step itself run in one process (tests/ranks.py).
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model as M  # noqa: E402
import train as T  # noqa: E402


def sgd_momentum_step(units, cfg, lr, step):
    """torch.optim.SGD(momentum=0.9) on the slices (no dampening, no decay): the first step's buffer is
    the gradient itself, as 0.9 * 0 + g is."""
    for u in units:
        momentum = u.optimizer_state["momentum_buffer"]
        momentum.mul_(0.9).add_(u.grad_shard)
        u.master_shard.add_(momentum, alpha=-lr)


Z_LOSS = 0.05  # PaLM's is 1e-4; large here, so that a run that logged the term but did not train on it fails


def z_loss_terms(self, h_normed, targets) -> dict:
    """model.Llama._loss_terms with PaLM's z-loss added: the one line a fork writes."""
    logits = torch.nn.functional.linear(h_normed, self.head_weight()).float()
    terms = {"ce": torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")}
    terms["z_loss"] = Z_LOSS * torch.logsumexp(logits, -1)[targets != -100].square().sum()
    return terms


BLOCK_UNITS = M.sharding_units  # the families': one unit per block


def two_units_per_block(model) -> list:
    """model.sharding_units of a fork that shards each block as two units: its attention with the norm before it
    (`layers.i.attention`), its MLP with its norm (`layers.i.mlp`). Llama's arithmetic, so Llama's oracle; what it
    checks is the trainer's: stages, --freeze, checkpoints, export and the planner from the model's unit list."""
    units = []
    for name, names in BLOCK_UNITS(model):
        if M.block_of(name) is None:
            units.append((name, names))
            continue
        attention = [n for n in names if ".self_attn." in n or ".input_layernorm." in n]
        units += [(f"{name}.attention", attention), (f"{name}.mlp", [n for n in names if n not in attention])]
    return units


LORA_RANK = 2
PLAIN_INIT = M.init_parameter  # the families' rule, which the forks below keep for their other parameters


class LoraBlock(M.Block):
    """A fork's adapter on each block's output, h + B(A(h)) (`lora_a`, `lora_b`), sharded as a unit of its own,
    `layers.i.lora` (lora_units), initialised by the fork's init hook (lora_init_parameter: B zero, so the fork starts
    as the base model): it trains beside a frozen base, and a new phase or a Hugging Face folder without it adds it."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.lora_a = torch.nn.Parameter(torch.empty(LORA_RANK, cfg.dim))
        self.lora_b = torch.nn.Parameter(torch.empty(cfg.dim, LORA_RANK))

    def forward(self, x, *args, **kwargs):
        h = super().forward(x, *args, **kwargs)
        return h + torch.nn.functional.linear(torch.nn.functional.linear(h, self.lora_a), self.lora_b)


def lora_init_parameter(name, full, std, generator, weight_of):
    """model.init_parameter of the LoRA fork: B zero (B(A(h)) = 0 at the start), everything else the family's rule."""
    if name.endswith("lora_b"):
        return full.zero_()
    PLAIN_INIT(name, full, std, generator, weight_of)


def lora_units(model, adapter: str = "lora") -> list:
    """model.sharding_units of the LoRA (DoRA) fork: each block, then its adapter (`layers.i.lora`, `layers.i.dora`)."""
    units = []
    for name, names in BLOCK_UNITS(model):
        new = [n for n in names if ".lora_" in n or n.endswith(".magnitude")]
        units += [(name, [n for n in names if n not in new])] + ([(f"{name}.{adapter}", new)] if new else [])
    return units


class DoraLinear(torch.nn.Linear):
    """DoRA (Liu et al., 2024) on a projection W (kept under its own name, frozen): m * (W + BA) / ||W + BA||, row by
    row, with the magnitude m (`magnitude`) and B, A trained. Initialised (dora_init_parameter) as m = ||W|| and B = 0:
    the layer starts as W."""

    def __init__(self, d_in, d_out):
        super().__init__(d_in, d_out, bias=False)
        self.lora_a = torch.nn.Parameter(torch.empty(LORA_RANK, d_in))
        self.lora_b = torch.nn.Parameter(torch.empty(d_out, LORA_RANK))
        self.magnitude = torch.nn.Parameter(torch.empty(d_out))

    def forward(self, x):
        w = self.weight + self.lora_b @ self.lora_a
        return torch.nn.functional.linear(x, w * (self.magnitude / w.norm(dim=1))[:, None])


class DoraBlock(M.Block):
    """A DoRA fork: q_proj and v_proj adapted (DoraLinear), the adapters of a block its unit `layers.i.dora`."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.self_attn.q_proj = DoraLinear(cfg.dim, cfg.n_heads * cfg.head_dim)
        self.self_attn.v_proj = DoraLinear(cfg.dim, cfg.n_kv_heads * cfg.head_dim)


def dora_init_parameter(name, full, std, generator, weight_of):
    """model.init_parameter of the DoRA fork: the magnitude is the norms of the rows of the weight it adapts (another
    unit's, gathered by weight_of); B zero, A and the rest the family's rule."""
    if name.endswith(".magnitude"):
        return full.copy_(weight_of(name.removesuffix("magnitude") + "weight").norm(dim=1))
    lora_init_parameter(name, full, std, generator, weight_of)


def dora_hf_tensors(name, tensor, weight_of):
    """model.hf_tensors of the DoRA fork: each adapted projection merged, m * (W + BA) / ||W + BA|| row by row,
    under the family's name, so the export is a plain Llama; the adapter's own parameters are written nowhere."""
    if name.endswith((".lora_a", ".lora_b", ".magnitude")):
        return {}
    stem = name.removesuffix("weight")
    if name.endswith(("q_proj.weight", "v_proj.weight")):
        merged = tensor + weight_of(stem + "lora_b") @ weight_of(stem + "lora_a")
        tensor = merged * (weight_of(stem + "magnitude") / merged.norm(dim=1))[:, None]
    return {M.hf_name(name): tensor}


def dora_units(model) -> list:
    return lora_units(model, "dora")


def record_tensorboard(out_dir):
    """A stand-in for torch.utils.tensorboard (not installed here): SummaryWriter writes each add_scalar as a
    JSON line."""
    import types

    class SummaryWriter:
        def __init__(self, log_dir):
            self.file = open(os.path.join(out_dir, "tensorboard.jsonl"), "w")

        def add_scalar(self, tag, value, step):
            self.file.write(json.dumps(dict(tag=tag, value=value, step=step)) + "\n")

        def close(self):
            self.file.close()
    sys.modules["torch.utils.tensorboard"] = types.SimpleNamespace(SummaryWriter=SummaryWriter)


def load(flags):
    """Counts the elements each rank reads from the safetensors files during --init_from."""
    import safetensors
    read = [0]
    real_open = safetensors.safe_open

    class CountingSlice:
        def __init__(self, s):
            self.s = s

        def get_shape(self):
            return self.s.get_shape()

        def __getitem__(self, index):
            out = self.s[index]
            read[0] += out.numel()
            return out

    class CountingFile:
        def __init__(self, *a, **k):
            self.f = real_open(*a, **k)

        def get_slice(self, name):
            return CountingSlice(self.f.get_slice(name))

        def keys(self):
            return self.f.keys()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False
    safetensors.safe_open = CountingFile
    cfg = T.parse_args(flags)
    sharded = T.setup(cfg)[0]
    units, rank, world = sharded.units, sharded.rank, sharded.world
    return dict(elements_read=read[0], shard_elements=sum(u.shard_numel for u in units),
                model_elements=sum(u.numel for u in units), rank=rank, world=world)


def facts(overrides: dict):
    """This rank sees another machine: ZERO3_TEST_FACTS is JSON {rank: {what: value}}. host, gloo (the address its
    hostname resolves to), netns (another machine's loopback), memlock (bytes), host_memory (bytes), flash_attn (a
    version installed), and checkpoints_up_to (a name: this rank does not see the newer step_* folders, and reads an
    older `latest`, as a node whose NFS or Lustre client still caches the listing before the last save), gpu_now (its
    GPU's name and memory outside PyTorch's allocator, as agree.before_step_one reads them), read (values merged into
    what agree.read_facts returns: {"nccl": "2.21.5"} makes a CPU rank report NCCL as a GPU rank does),
    init_fails (a message: init_process_group raises it, as NCCL's set-up does when ibv_reg_mr fails), and
    slow_load_s (this rank's --init_from or resume takes that many seconds longer). What the code reads is
    replaced where it reads it, so the same patches apply to the code before components/agree.py too."""
    import types
    from components import checkpoints, checks, hf
    try:
        from components import agree
        agree.CHECKPOINT_WAIT_S, agree.CHECKPOINT_POLL_S = 2.0, 0.5
    except ImportError:  # the code before it (the tests were run there once, to see them fail)
        agree = None
    if "host" in overrides and agree:
        agree.host_name = lambda env=None: overrides["host"]
    if "netns" in overrides and agree:
        agree.network_namespace = lambda: overrides["netns"]
    if "gloo" in overrides and agree:
        agree.gloo_address = lambda hostname, env=None: overrides["gloo"]
    if "memlock" in overrides and agree:
        agree.memlock_bytes = lambda: overrides["memlock"]
    if "host_memory" in overrides:
        checks.host_memory_limit = lambda *a, **k: (overrides["host_memory"], "this machine has "
                                                    f"{overrides['host_memory'] / 2**30:.1f} GiB available")
    if "flash_attn" in overrides:
        sys.modules["flash_attn"] = types.SimpleNamespace(__version__=overrides["flash_attn"])
        M.flash_attn_func = M.flash_attn_varlen_func = lambda *a, **k: None  # CPU: never called (model.uses_flash)
    if "gpu_now" in overrides and agree:  # {"name": a CUDA device name, "outside": bytes, "total": bytes}
        agree.gpu_now = lambda device: overrides["gpu_now"]
        agree.gpu_name = lambda device: overrides["gpu_now"]["name"]  # the GPU the planner is asked about
    if "read" in overrides and agree:
        read_facts = agree.read_facts
        agree.read_facts = lambda *a, **k: {**read_facts(*a, **k), **overrides["read"]}
    if "init_fails" in overrides:
        def init_process_group(*args, **kwargs):
            raise RuntimeError(overrides["init_fails"])
        torch.distributed.init_process_group = init_process_group
    if "slow_load_s" in overrides:
        import time
        for module, name in ((hf, "init_weights"), (checkpoints, "resume")):
            def slow(*args, load=getattr(module, name), **kwargs):
                time.sleep(overrides["slow_load_s"])
                return load(*args, **kwargs)
            setattr(module, name, slow)
    if "checkpoints_up_to" in overrides:
        newest, list_checkpoints = overrides["checkpoints_up_to"], checkpoints.list_checkpoints
        checkpoints.list_checkpoints = lambda root: [p for p in list_checkpoints(root) if os.path.basename(p) <= newest]
        checkpoints.latest_name = lambda root: newest
        checkpoints.candidates_on_disk = lambda root: checkpoints.list_checkpoints(root)  # the code before: its own reading


if __name__ == "__main__":
    mode, out_dir, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
    if mode == "sgd":  # a second optimizer, swapped in where train.py says a fork swaps it; then a whole run
        M.OPTIMIZER_STATE, T.optimizer_step = ("momentum_buffer",), sgd_momentum_step
        T.main(flags)
        os._exit(0)
    if mode == "zloss":
        M.Llama._loss_terms = z_loss_terms
        record_tensorboard(out_dir)
        T.main(flags)
        os._exit(0)
    if mode == "two_units":
        M.sharding_units = two_units_per_block
        T.main(flags)
        os._exit(0)
    if mode in ("lora", "dora"):
        M.Block, M.sharding_units, M.init_parameter = {"lora": (LoraBlock, lora_units, lora_init_parameter),
                                                       "dora": (DoraBlock, dora_units, dora_init_parameter)}[mode]
        M.hf_tensors = dora_hf_tensors if mode == "dora" else M.hf_tensors
        T.main(flags)
        os._exit(0)
    if mode == "facts":
        facts(json.loads(os.environ.get("ZERO3_TEST_FACTS", "{}")).get(os.environ["RANK"], {}))
        T.main(flags)
        settings = ("NCCL_NVLS_ENABLE", "PYTORCH_ALLOC_CONF", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                    "TORCH_FR_DUMP_TEMP_FILE")
        with open(os.path.join(out_dir, f"env_rank{os.environ['RANK']}.json"), "w") as f:
            json.dump({name: os.environ.get(name) for name in settings}, f)
        os._exit(0)
    if mode == "load":
        result = load(flags)
    with open(os.path.join(out_dir, f"rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()
    os._exit(0)  # no interpreter teardown: gloo's threads can abort it (see the end of train.py)
