"""Hugging Face folders, and where a run's model comes from: its config (model_config: a checkpoint's manifest, an
--init_from folder's config.json, or a preset) and its first weights (init_weights: seeded, an --init_from folder's
read by partial reads, or one of our checkpoints'); what an export will be (config_to_hf, check_export_tensors), the
export itself being tools/export_hf.py's, run on a checkpoint (export_checkpoint: docs/data.md, "Hugging Face import
and export")."""
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict

import torch
import torch.distributed as dist

import data as D
import model as M
from components import checkpoints  # our checkpoints: a new phase's weights, the manifests an export follows
from components import flags  # check_param_groups: --freeze and --lr_mult against the model
from components import out_dir as OD  # the file helpers, the checkpoint group
from components import run_data  # the folder recording --data's tokenizer
from components.out_dir import CheckpointError



# The model a run builds, from the files its flags name (components/checks.py and the planner both ask).

def checkpoint_source(cfg) -> str | None:
    """The checkpoint folder --init_from means when not a Hugging Face folder (checkpoints.find_checkpoint)."""
    path = cfg.init_from
    if not path or os.path.isfile(os.path.join(path, "config.json")):
        return None
    if not os.path.isdir(path):
        raise CheckpointError(f"--init_from: {path} is not a folder")
    try:
        found = checkpoints.find_checkpoint(path)
    except CheckpointError as e:
        raise CheckpointError(f"--init_from: {e}") from None
    if found is None:
        raise CheckpointError(f"--init_from: {path} is neither a Hugging Face folder (no config.json) nor one of our "
                              f"checkpoints (no manifest.json, and no checkpoints/step_* folder in it)")
    return found


# What a preset takes from the prepared data's tokenizer (run_data.open_data), so a checkpoint of a preset differs
# from the preset there; any other difference means another model.
DATA_DECIDES = ("vocab_size", "bos_id", "eos_id")


def model_config(cfg) -> M.ModelConfig:
    """The model: a checkpoint's manifest's (a --model beside --init_from must be the same), an --init_from folder's
    config.json, or a preset."""
    checkpoint = checkpoint_source(cfg)
    if checkpoint:
        try:
            mcfg = M.ModelConfig(**OD.load_json(os.path.join(checkpoint, "manifest.json"))["model"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"--init_from: checkpoint {checkpoint}: manifest.json has no readable model ({e})") from None
        if cfg.model:
            preset, saved = asdict(M.PRESETS[cfg.model]()), asdict(mcfg)
            diff = [f"{k} {preset[k]} vs {v}" for k, v in saved.items() if k not in DATA_DECIDES and preset[k] != v]
            if diff:
                raise CheckpointError(f"--model: {cfg.model} is not the model of --init_from {checkpoint}, which "
                                      f"decides the model (its manifest.json): they differ in {', '.join(diff)}; "
                                      f"leave out --model")
        return mcfg
    if cfg.init_from:
        return config_from_hf(OD.load_json(os.path.join(cfg.init_from, "config.json")))
    return M.PRESETS[cfg.model or "tiny"]()



def check_start(cfg) -> tuple:
    """(model config, where the first weights come from, errors): the model the flags name and the files of its
    first weights, read before any work. The weights: None (seeded), {HF tensor name: file} (an --init_from Hugging
    Face folder), or a checkpoint folder (--init_from one of ours: its manifest and file sizes
    checked here, its SHA-256 as it is read); with --export_hf, what transformers will build from its config."""
    errors, mcfg, weights = [], None, None
    try:
        weights = checkpoint_source(cfg)
        mcfg = model_config(cfg)
    except OD.CheckpointError as e:
        errors.append(str(e))
    except (KeyError, json.JSONDecodeError) as e:
        errors.append(f"--init_from: cannot read config.json: {e}")
    except ValueError as e:  # config.json describes a model this code does not build
        errors.append(f"--init_from: {e}")
    if mcfg is not None:
        errors += M.check_model_config(mcfg) or flags.check_param_groups(cfg, mcfg)
    if not errors and weights is not None:
        try:
            with torch.device("meta"):
                numels = M.numels_by_unit(M.Llama(mcfg))
            checkpoints.check_checkpoint_files(weights, "--init_from", numels)
        except OD.CheckpointError as e:
            errors.append(str(e))
    if not errors and weights is not None and cfg.steps > 0:
        errors += check_phase_tokenizer(cfg, weights)
    if not errors and cfg.init_from and weights is None:
        try:  # headers only: a bad weight file is one line here, not a traceback at load
            weights = hf_file_of_tensors(cfg.init_from)
            check_hf_tensors(weights, mcfg, cfg.init_from)
        except (ValueError, FileNotFoundError) as e:
            errors.append(str(e))
    if not errors and cfg.export_hf:
        errors += check_export(mcfg)
    return mcfg, weights, errors


def check_phase_tokenizer(cfg, checkpoint: str) -> list[str]:
    """A new phase from one of our checkpoints trains on data of the model's tokenizer: the one that
    prepared the data of the run that saved it (or of its own origin), when both are known."""
    theirs = export_origin(OD.load_json(os.path.join(checkpoint, "manifest.json"))["train"])["tokenizer"]
    ours = tokenizer_record(asdict(cfg))
    if ours and theirs and ours["sha256"] != theirs["sha256"]:
        return [f"--data: {cfg.data} was tokenized with {ours['path']}, and the model of --init_from {checkpoint} was "
                f"trained on data tokenized with {theirs['path']}, another tokenizer; prepare the data with that one"]
    return []


def check_export(mcfg: M.ModelConfig) -> list[str]:
    """--export_hf: what transformers builds from this model's config.json must be this model, found now rather
    than after the training (check_export_tensors on model.hf_tensors' names; the export tool run alone checks
    again, at the end of this run it does not)."""
    with torch.device("meta"):
        params = dict(M.Llama(mcfg).named_parameters())
    shapes = {hf: tuple(t.shape) for n, p in params.items() for hf, t in M.hf_tensors(n, p, params.get).items()}
    try:
        check_export_tensors(config_to_hf(mcfg, torch.float32), shapes)
    except ValueError as e:
        return [str(e)]
    return []


def init_unit_random(unit, index: int, seed: int, std: float, weight_of):
    """model.init_parameter on each of the unit's parameters at its whole shape, from the unit's own generator, then
    keep this rank's shard: the same weights for every W."""
    device = unit.gathered.device  # the same numbers with and without --offload_optimizer
    gen = torch.Generator(device=device).manual_seed(seed * 100003 + index)
    full = torch.zeros(unit.padded_numel, dtype=torch.float32, device=device)
    for slot in unit.slots:
        piece = full[slot.offset:slot.offset + math.prod(slot.shape)].view(slot.shape)
        M.init_parameter(slot.name, piece, std, gen, weight_of)
    unit.master_shard.copy_(full[unit.shard_start:unit.shard_start + unit.shard_numel])


def whole_parameter(units: list, name: str) -> torch.Tensor:
    """model.init_parameter's `weight_of`: parameter `name`'s whole fp32 tensor, all-gathered from its unit's shards."""
    unit, slot = {slot.name: (unit, slot) for unit in units for slot in unit.slots}[name]
    full = torch.empty(unit.padded_numel, dtype=torch.float32, device=unit.gathered.device)
    OD.all_gather_flat(full, unit.master_shard.to(full.device))  # from host memory with --offload_optimizer
    return full[slot.offset:slot.offset + math.prod(slot.shape)].view(slot.shape)


def init_weights(cfg, mcfg: M.ModelConfig, units: list, weights: dict | str | None) -> str | None:
    """Seeded random weights (`weights` None); or this rank's shards of the units an --init_from Hugging Face folder
    (`weights` {HF tensor name: file}) or one of our checkpoints (`weights` its folder: a new phase, a fresh optimizer)
    holds, the units it lacks (a fork's adapter) initialised as a run from scratch initialises them, after the units
    taken (model.init_parameter may read those). Returns, for a start from other weights, the line naming both."""
    checkpoints.forget_frozen_set()  # this run did not resume: its first save writes its frozen units' set
    if isinstance(weights, str):
        saved = checkpoints.load_weights(weights, units, "--init_from")["units"]  # the manifest every rank read: agreed
        taken = {unit.name for unit in units if unit.name in saved}
    else:  # a Hugging Face folder's units: whole ones (check_hf_tensors), read from the files' headers by every rank
        taken, open_files = {u.name for u in units if M.hf_name(u.slots[0].name) in (weights or {})}, {}
        for unit in [u for u in units if u.name in taken]:
            load_unit_from_hf(unit, weights, open_files)
    new = [(i, unit) for i, unit in enumerate(units) if unit.name not in taken]
    for i, unit in new:
        init_unit_random(unit, i, cfg.seed, mcfg.init_std, lambda name: whole_parameter(units, name))
    if weights is None:
        return None
    source = (f"checkpoint {weights} (a new phase: step 1, a fresh optimizer and data position)"
              if isinstance(weights, str) else f"Hugging Face folder {cfg.init_from}")
    taken_names, new_names = [u.name for u in units if u.name in taken], [u.name for _, u in new]
    return (f"started from the weights of {source}; taken: {checkpoints.unit_list(taken_names)}; new, initialised as a "
            f"run from scratch (--seed {cfg.seed}): {checkpoints.unit_list(new_names) or 'none'}")


# ================================================================================================
# Hugging Face folders: import by partial reads, export one unit at a time
# ================================================================================================

# config.json, both forms seen in the wild: the published Llama 3.x one (`rope_theta` + `rope_scaling`) and
# transformers 5's (`rope_parameters`). Written in the published form, which every transformers version reads.

def hf_rope(hf: dict) -> tuple[dict, str]:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return rope, rope.get("rope_type", rope.get("type", "default"))


def check_hf_config(hf: dict) -> list[str]:
    """What in a config.json says it is not a model this code builds (model.FAMILIES), one line each: Qwen2, Gemma
    and Mistral name their tensors as Llama does, and would load, and train as another model, without a word."""
    model_type, architectures = hf.get("model_type"), hf.get("architectures") or []
    family = M.FAMILIES.get(model_type)
    if family is None or architectures not in ([], [family["hf_class"]]):
        known = ", ".join(f"model_type {t!r} with {f['hf_class']}" for t, f in M.FAMILIES.items())
        return [f"model_type {model_type!r} (architectures {', '.join(architectures) or 'not given'}) is not a "
                f"family this code builds; known: {known}"]
    problems = []  # a config.json of a known family with options this code does not implement
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    for bias in ("attention_bias", "mlp_bias"):
        if hf.get(bias, False):
            problems.append(f"{bias} true is not supported (this model has no biases)")
    if hf.get("attention_dropout", 0.0):
        problems.append(f"attention_dropout {hf['attention_dropout']} is not supported (only 0.0)")
    if hf.get("use_sliding_window", False):
        problems.append("use_sliding_window true is not supported (only full attention)")
    rope_type = hf_rope(hf)[1]
    if rope_type not in family["rope_types"]:
        problems.append(f"rope type {rope_type!r} is not supported for {model_type} (only {' and '.join(family['rope_types'])})")
    return problems


def config_from_hf(hf: dict) -> M.ModelConfig:
    """Either form of config.json; anything but a family of model.FAMILIES, as it is published, is refused
    (check_hf_config), never approximated."""
    problems = check_hf_config(hf)
    if problems:
        raise ValueError("config.json: " + "; ".join(problems))
    rope, rope_type = hf_rope(hf)
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = None
    if rope_type == "llama3":
        scaling = {k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                         "original_max_position_embeddings")}
    eos = hf.get("eos_token_id", 2)
    family = M.FAMILIES[hf["model_type"]]
    return M.ModelConfig(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"], n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or 0, ffn_dim=hf["intermediate_size"], norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta), rope_scaling=scaling, max_seq_len=hf.get("max_position_embeddings", 8192),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), bos_id=hf.get("bos_token_id", 1),
        eos_id=eos[0] if isinstance(eos, list) else eos, pad_id=hf.get("pad_token_id"),
        init_std=hf.get("initializer_range", 0.02), family=hf["model_type"], **family["model_fields"],
        family_keys={key: hf[key] for key in family["config_keys"] if key in hf})


# A source config.json's keys for what config_to_hf writes in another spelling (transformers 5 writes
# `rope_parameters` and `dtype`): dropped, so the two spellings cannot disagree.
HF_RESPELLED = ("rope_parameters", "rope_scaling", "rope_theta", "dtype", "torch_dtype")


def config_to_hf(cfg: M.ModelConfig, dtype: torch.dtype, source: dict | None = None, eos_ids: list | None = None) -> dict:
    """The published form of cfg's family. `source`: the --init_from config.json, whose other fields are kept, and
    its end-id list when it starts with cfg.eos_id (Llama 3.1 Instruct's three; training needs only the first).
    `eos_ids`: the tokenizer's end ids, for a model without a source."""
    family = M.FAMILIES[cfg.family]
    ours = {
        "architectures": [family["hf_class"]], "model_type": cfg.family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_dim, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling, rope_type="llama3") if cfg.rope_scaling else None,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "initializer_range": cfg.init_std, "use_cache": True, "torch_dtype": str(dtype).removeprefix("torch."),
        **cfg.family_keys,
    }
    if cfg.pad_id is not None:
        ours["pad_token_id"] = cfg.pad_id
    if eos_ids and eos_ids[0] == cfg.eos_id:
        ours["eos_token_id"] = list(eos_ids) if len(eos_ids) > 1 else cfg.eos_id
    source = source or {}
    source_eos = source.get("eos_token_id")
    if isinstance(source_eos, list) and source_eos and source_eos[0] == cfg.eos_id:
        ours["eos_token_id"] = source_eos
    return dict({k: v for k, v in source.items() if k not in HF_RESPELLED}, **ours)


def hf_file_of_tensors(folder: str) -> dict:
    """{HF tensor name: safetensors file}, from the files' own headers (the index only says which files there are):
    a file lacking what the index promises shows as a missing tensor, a damaged one is found before any training."""
    from safetensors import SafetensorError, safe_open
    index = os.path.join(folder, "model.safetensors.index.json")
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(index):
        try:
            tensor_files = list(OD.load_json(index)["weight_map"].items())  # (tensor name, file name)
        except (ValueError, KeyError, AttributeError, TypeError) as e:
            raise ValueError(f"--init_from: {index} is not a safetensors index ({e!r}); download it again") from None
        for name, fname in tensor_files:  # a file of this folder (links are fine: the Hub's cache is made of them)
            if not D.is_plain_name(fname):
                raise ValueError(f"--init_from: {index} names {fname!r} as the file of {name}, which is not a file "
                                 f"name in {folder} (a '/' or '..'); download the model again")
        paths = sorted({os.path.join(folder, fname) for _, fname in tensor_files})
    elif os.path.isfile(single):
        paths = [single]
    else:
        raise FileNotFoundError(f"--init_from: neither model.safetensors nor model.safetensors.index.json in {folder}")
    files = {}
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--init_from: {path} is named in {index} but does not exist")
        try:  # safe_open checks the header covers the file: a truncated download or an HTML page fails here
            with safe_open(path, framework="pt") as f:
                files.update({name: path for name in f.keys()})
        except SafetensorError as e:
            raise ValueError(f"--init_from: {path} is not a readable safetensors file ({e}); download it "
                             f"again") from None
    return files


def check_hf_tensors(files: dict, mcfg: M.ModelConfig, folder: str):
    """The files hold config.json's model, each unit whole: an extra tensor (a Qwen2 q_proj.bias, a rotary inv_freq,
    lm_head.weight beside tied embeddings) is refused, never dropped: the weights are another model's. A unit none of
    whose tensors is there is a fork's new one (init_weights initialises it), unless it lacks a tensor of the family
    (family_tensors): a folder missing blocks of the plain model is damaged, never a start."""
    with torch.device("meta"):  # names only: allocates nothing
        units = {unit: [M.hf_name(n) for n in names] for unit, names in M.sharding_units(M.Llama(mcfg))}
    expected = {name for names in units.values() for name in names}
    missing, unexpected = sorted(expected - files.keys()), sorted(files.keys() - expected)
    config = OD.load_json(os.path.join(folder, "config.json")) if missing else {}
    family_missing = sorted(family_tensors(config).keys() & set(missing)) if missing else []
    if family_missing:
        raise ValueError(f"--init_from: tensor {family_missing[0]}{more(family_missing)} is missing from the "
                         f"safetensors files in {folder}")
    for unit, names in units.items():
        lacking = [name for name in names if name not in files]
        if 0 < len(lacking) < len(names):
            raise ValueError(f"--init_from: tensor {lacking[0]}{more(lacking)} of unit {unit} is missing from the "
                             f"safetensors files in {folder}, which hold its other tensors: a damaged folder (a fork's "
                             f"new parameters start from it only as whole units of their own: model.sharding_units)")
    if unexpected:
        hint = ""
        if "lm_head.weight" in unexpected and mcfg.tie_embeddings:
            hint = "; config.json has tie_word_embeddings true: set it false if lm_head.weight is the model's own"
        raise ValueError(f"--init_from: {files[unexpected[0]]} holds {unexpected[0]}{more(unexpected)}, which the "
                         f"{M.FAMILIES[mcfg.family]['hf_class']} described by config.json does not have: this is not "
                         f"a plain {mcfg.family} checkpoint{hint}")


def family_tensors(config: dict) -> dict:
    """{name: shape} of what save_pretrained writes for transformers' class of the family, built from `config` (a
    config.json's) on the meta device: the family's tensors, none of a fork's (hf_saved_tensors)."""
    import transformers
    family = M.FAMILIES[config["model_type"]]
    with torch.device("meta"):
        config = getattr(transformers, family["hf_config_class"]).from_dict(json.loads(json.dumps(config)))  # a copy:
        hf = getattr(transformers, family["hf_class"])(config)  # from_dict writes rope_theta into its rope_scaling
    return {name: tuple(t.shape) for name, t in hf_saved_tensors(hf).items()}


def more(names: list) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def load_unit_from_hf(unit, files: dict, open_files: dict):
    """Reads only this rank's shard of each parameter: at most one extra row on each side, then cut away."""
    from safetensors import safe_open
    lo_shard, hi_shard = unit.shard_start, unit.shard_start + unit.shard_numel
    for slot in unit.slots:
        name, shape, offset = slot.name, slot.shape, slot.offset
        lo, hi = max(offset, lo_shard), min(offset + math.prod(shape), hi_shard)
        if lo >= hi:
            continue
        key = M.hf_name(name)  # in `files`: a unit taken from the folder is whole there (check_hf_tensors)
        if files[key] not in open_files:
            open_files[files[key]] = safe_open(files[key], framework="pt")
        tensor_slice = open_files[files[key]].get_slice(key)
        if tuple(tensor_slice.get_shape()) != shape:
            raise ValueError(f"--init_from: {key} in {files[key]} has shape {tuple(tensor_slice.get_shape())}, "
                             f"config.json implies {shape}")
        a, b = lo - offset, hi - offset  # flat range within this parameter
        row = math.prod(shape[1:])       # elements per row (1 for a 1-D norm weight)
        r0, r1 = a // row, -(-b // row)
        rows = tensor_slice[r0:r1].reshape(-1)
        unit.master_shard[lo - lo_shard:hi - lo_shard] = rows[a - r0 * row:b - r0 * row].float()


def check_export_tensors(config: dict, shapes: dict):
    """What transformers builds from `config` (on the meta device) saves exactly the tensors `shapes` names:
    from_pretrained drops a tensor it does not know with a warning, serving a fork's model as another."""
    family, built = M.FAMILIES[config["model_type"]], family_tensors(config)
    extra, missing = sorted(shapes.keys() - built.keys()), sorted(built.keys() - shapes.keys())
    reshaped = sorted(n for n in shapes.keys() & built.keys() if tuple(shapes[n]) != built[n])
    where = f"the {family['hf_class']} that transformers builds from the exported config.json"
    if extra:
        raise ValueError(f"--export_hf: tensor {extra[0]}{more(extra)} of this model is not in {where}: from_pretrained "
                         f"would drop it and serve another model; a model with parameters its family lacks cannot be "
                         f"exported as one (config_to_hf describes what the export is; model.FAMILIES the families)")
    if missing:
        raise ValueError(f"--export_hf: {where} has {missing[0]}{more(missing)}, which this model lacks")
    if reshaped:
        raise ValueError(f"--export_hf: tensor {reshaped[0]}{more(reshaped)} has shape {tuple(shapes[reshaped[0]])} "
                         f"here and {built[reshaped[0]]} in {where}")


def hf_saved_tensors(hf) -> dict:
    """The tensors save_pretrained writes for the transformers model `hf` (on the meta device too), by their names
    on disk: tied embeddings once, and transformers 5's in-memory fusions undone (Mixtral's experts are one
    tensor in memory, a weight per expert on disk, as other readers of the folder expect)."""
    tensors = dict(hf.named_parameters())  # tied embeddings: listed once
    try:
        from transformers.core_model_loading import revert_weight_conversion  # transformers 5
    except ImportError:
        return tensors  # transformers 4 saves what it holds
    return revert_weight_conversion(hf, tensors)


def export_origin(train: dict, depth: int = 0) -> dict:
    """Where an export's other files come from, for the run whose TrainConfig is `train`: {"hf_folder": the Hugging
    Face folder its first weights came from or None, "tokenizer": tokenizer_record's}. A run from one of our
    checkpoints (a phase, --from_ckpt) has the origin of the run that saved it, through the manifests."""
    init = train.get("from_ckpt") or train.get("init_from") or ""
    if init and not os.path.isfile(os.path.join(init, "config.json")) and depth < 100:
        try:
            manifest = OD.load_json(os.path.join(checkpoints.find_checkpoint(init), "manifest.json"))
            return export_origin(manifest["train"], depth + 1)
        except (CheckpointError, OSError, ValueError, KeyError, TypeError):
            pass  # that run's folder is gone: what this run's own --data says
    hf_folder = init if init and os.path.isfile(os.path.join(init, "config.json")) else None
    return {"hf_folder": hf_folder, "tokenizer": tokenizer_record(train)}


def tokenizer_record(train: dict) -> dict | None:
    """The tokenizer that prepared a run's --data, as its meta.json records it ({path, kind, sha256}), or None."""
    folder = run_data.first_prepared_folder(train.get("data") or "", train.get("out_dir") or "")  # a mix: one tokenizer
    try:
        tokenizer = OD.load_json(os.path.join(folder, "meta.json"))["tokenizer"]
        return {k: tokenizer[k] for k in ("path", "kind", "sha256")}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def source_json(source: str | None, name: str):
    path = os.path.join(source or "", name)
    return OD.load_json(path) if source and os.path.isfile(path) else None


EXPORT_TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "export_hf.py")


def export_tool(checkpoint: str, cfg, dtype: torch.dtype, *mode: str) -> tuple[int, str]:
    """tools/export_hf.py on `checkpoint` into --export_hf, in a subprocess (the trainer never imports a tool): (its
    exit code, its error line). Its other lines are printed as it ends."""
    command = [sys.executable, EXPORT_TOOL, checkpoint, cfg.export_hf, f"--dtype={str(dtype).removeprefix('torch.')}",
               f"--shard_gb={cfg.export_shard_gb}", f"--flag={'--from_ckpt' if cfg.from_ckpt else '--out_dir'}", *mode]
    try:
        proc = subprocess.run(command, capture_output=True, text=True)
    except OSError as e:
        return 1, f"--export_hf: cannot run {EXPORT_TOOL} ({e})"
    print(proc.stdout, end="", flush=True)
    lines = proc.stderr.splitlines()
    print("".join(line + "\n" for line in lines if not line.startswith("error: ")), end="", file=sys.stderr, flush=True)
    errors = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
    return proc.returncode, (errors or lines or [f"--export_hf: {EXPORT_TOOL} exited with {proc.returncode}"])[-1]


def export_checkpoint(checkpoint: str, cfg, dtype: torch.dtype, rank: int, world: int) -> tuple[int, str]:
    """--export_hf from the checkpoint this run has just written: every rank writes its share of the weight files at
    once (tools/export_hf.py --part: 1/W of the reads and writes each), then rank 0 the rest (--finish). (Exit code,
    line), the same on every rank: a rank's failure is its own line there, and names it on the others. One rank:
    one process does both."""
    if world == 1:
        return export_tool(checkpoint, cfg, dtype, "--written_now")
    code, error = export_tool(checkpoint, cfg, dtype, f"--part={rank}", f"--parts={world}", "--written_now")
    codes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(codes, torch.tensor([code]), group=OD.group)  # gloo, --ckpt_timeout_min: parts take minutes
    failed = [r for r in range(world) if codes[r].item()]
    if failed:
        return codes[failed[0]].item(), error if rank == failed[0] else f"--export_hf: rank {failed[0]} could not " \
                                                                        f"write its part (its line says why)"
    finished = torch.tensor([0])
    if rank == 0:
        finished[0], error = export_tool(checkpoint, cfg, dtype, "--finish", "--written_now")
    dist.broadcast(finished, src=0, group=OD.group)
    return finished.item(), error if rank == 0 else "--export_hf: rank 0 could not finish it (its line says why)"


def export_alone(cfg, device) -> tuple[int, str]:
    """--from_ckpt DIR --export_hf OUT (or a finished run's missing export): the checkpoint exported by one
    process, tools/export_hf.py, before any process group; under torchrun by rank 0, the others with nothing to do."""
    errors = flags.check_config(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    if errors or os.environ.get("RANK", "0") != "0":
        return (2, "; ".join(errors)) if errors else (0, "")
    return export_tool(cfg.from_ckpt, cfg, flags.compute_dtype(cfg.dtype, device))
