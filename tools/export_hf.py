"""The Hugging Face export: one of our checkpoints as a folder that transformers' from_pretrained and AutoTokenizer
load as is. One process reads the checkpoint a unit at a time, whatever world size saved it: no GPU and no process
group, so a 70B checkpoint converts on any machine that sees its files, and holds one output file's tensors at a time.
A tool: the trainer runs it as a command (--export_hf at the end of a run, --from_ckpt) and never imports it.

    python tools/export_hf.py CHECKPOINT OUT [--dtype bfloat16] [--shard_gb 5]

CHECKPOINT: a step_* folder, or an --out_dir (its latest). OUT gets model*.safetensors (+ index), config.json,
generation_config.json and the tokenizer that prepared the run's --data (docs/data.md, "Hugging Face import and
export"). It is written to OUT.partial and renamed: it appears complete or not at all. Errors are one line; exit
code 2 when running it again cannot help (processes.exit_code's rule), else 1.
"""
import argparse
import errno
import json
import math
import os
import shutil
import sys
import tempfile
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
import data as D  # noqa: E402
import model as M  # noqa: E402
from tools import tokenizer as TK  # noqa: E402
from components import checkpoints, hf  # noqa: E402
from components import out_dir as OD  # noqa: E402
from components.processes import exit_code  # noqa: E402

# tokenizer: a server then renders chats as they were trained.
HEADER_FORMAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
                          "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
                          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# A Hugging Face tokenizer's files: what an export copies from an --init_from folder, when there.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                      "chat_template.jinja", "chat_template.json", "added_tokens.json")
# English, French, chat markup, digits, whitespace runs, symbols, emoji, CJK and a control character: an
# exported tokenizer must encode this exactly as the one that prepared the data (write_hf_tokenizer).
ENCODING_PROBE = ("The lessee shall pay 1,250.00 EUR on the 1st. Le bailleur a résilié le contrat à défaut de "
                  "paiement ; « Où est-il ? » <|start_header_id|>user<|end_header_id|>\n\nBonjour\t  !<|eot_id|> "
                  "x<|eot_id|>y  ☃ ℃ ½ 😀 中文 \x00 \r\n end")


# ================================================================================================
# The tokenizer and the other files
# ================================================================================================

def copy_hf_tokenizer_files(folder: str, out: str) -> list:
    """Copies the HF_TOKENIZER_FILES `folder` has into `out` (contents only: modes follow the umask)."""
    names = [n for n in HF_TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))]
    for name in names:
        shutil.copyfile(os.path.join(folder, name), os.path.join(out, name))
    return names


def write_hf_tokenizer(path: str, sha256: str, out: str) -> list:
    """Writes into `out` what transformers' AutoTokenizer loads for the tokenizer meta.json records (`path`,
    `sha256`): a Hugging Face tokenizer's files are copied, a sentencepiece model converted. Returns its end ids."""
    if not os.path.exists(path):
        raise D.DataError(f"the tokenizer that prepared --data, {path}, is not there")
    tok = TK.Tokenizer(path)
    if tok.sha256 != sha256:
        raise D.DataError(f"{path} has changed since it prepared --data (another SHA-256)")
    if tok.kind == "huggingface":
        copy_hf_tokenizer_files(path if os.path.isdir(path) else os.path.dirname(path), out)
    else:
        sentencepiece_to_hf(tok, out)
    return tok.end_ids()


def sentencepiece_to_hf(tok: TK.Tokenizer, out: str):
    """tokenizer.json and tokenizer_config.json for a sentencepiece model, converted by transformers (it needs
    protobuf), with BOS added as prepare adds it and the header format's chat template. A conversion that
    does not encode ENCODING_PROBE as sentencepiece does gives no tokenizer, never a wrong one. The one
    difference left: a literal "<s>" in text is the control token to transformers, text to sentencepiece."""
    from transformers import AutoTokenizer
    sp = tok.sp
    config = {"tokenizer_class": "TokenizersBackend", "bos_token": sp.id_to_piece(sp.bos_id()),
              "eos_token": sp.id_to_piece(sp.eos_id()), "unk_token": sp.id_to_piece(sp.unk_id()),
              "add_bos_token": True, "add_eos_token": False}
    if all(tok.piece_id(t) is not None for t in TK.CHAT_TOKENS):
        config["chat_template"] = HEADER_FORMAT_TEMPLATE
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(tok.path, os.path.join(tmp, "tokenizer.model"))
        with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
            json.dump(config, f)
        try:
            tokenizer = AutoTokenizer.from_pretrained(tmp)
        except Exception as e:  # noqa: BLE001 (what fails depends on the transformers version: name it, go on)
            raise D.DataError(f"transformers could not convert {tok.path} ({type(e).__name__}: {e}; it needs the "
                              f"protobuf package)") from None
    if tokenizer(ENCODING_PROBE)["input_ids"] != [sp.bos_id()] + tok.encode([ENCODING_PROBE], True)[0]:
        raise D.DataError(f"transformers' conversion of {tok.path} encodes differently from sentencepiece")
    tokenizer.save_pretrained(out)


def export_tokenizer(origin: dict, folder: str) -> tuple[list | None, str]:
    """The tokenizer's files into `folder`: an --init_from folder's copied, else --data's written
    (write_hf_tokenizer), else none and a warning. Returns (its end ids or None, what was written)."""
    source = origin.get("hf_folder")
    if source and any(os.path.isfile(os.path.join(source, n)) for n in ("tokenizer.json", "tokenizer.model")):
        copied = copy_hf_tokenizer_files(source, folder)
        return None, f"tokenizer files copied from {source}: {', '.join(copied)}"
    tokenizer = origin.get("tokenizer")
    why = "--data is a token .npy, which names no tokenizer"
    if tokenizer:
        try:
            end_ids = write_hf_tokenizer(tokenizer["path"], tokenizer["sha256"], folder)
            return end_ids, f"tokenizer from {tokenizer['path']}"
        except D.DataError as e:
            why = str(e)
    print(f"warning: --export_hf: no tokenizer files in the export ({why}); copy the tokenizer's files into it "
          f"before loading it with AutoTokenizer", file=sys.stderr, flush=True)
    return None, "no tokenizer"


def finish_export(folder: str, mcfg: M.ModelConfig, dtype: torch.dtype, origin: dict, shapes: dict,
                  check: bool = True) -> str:
    """Everything of an export but the weights: the tokenizer, config.json, generation_config.json (the --init_from
    folder's, sampling defaults included; else the BOS and end ids) and, with `check`, hf.check_export_tensors.
    Returns the note."""
    end_ids, tokenizer_note = export_tokenizer(origin, folder)
    source = origin.get("hf_folder")
    config = hf.config_to_hf(mcfg, dtype, source=hf.source_json(source, "config.json"), eos_ids=end_ids)
    if check:
        hf.check_export_tensors(config, shapes)
    generation = hf.source_json(source, "generation_config.json") or {"bos_token_id": config["bos_token_id"],
                                                                      "eos_token_id": config["eos_token_id"]}
    for name, content in (("config.json", config), ("generation_config.json", generation)):
        with open(os.path.join(folder, name), "w") as f:
            json.dump(content, f, indent=2)
    return tokenizer_note


# ================================================================================================
# The weights, a unit at a time
# ================================================================================================

def unit_params(manifest: dict) -> dict:
    """{unit name: [(parameter name, shape)]}, in the unit's flat order: as the manifest records them
    (checkpoints.unit_records), so a fork's checkpoint exports without the fork's code; else this model.py's."""
    if all("params" in saved for saved in manifest["units"].values()):
        return {name: [(p, tuple(shape)) for p, shape in saved["params"]] for name, saved in manifest["units"].items()}
    with torch.device("meta"):
        model = M.Llama(M.ModelConfig(**manifest["model"]))
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return {unit: [(p, shapes[p]) for p in names] for unit, names in M.sharding_units(model)}


class CheckpointReader:
    """Reads whole units of one checkpoint in fp32 (checkpoints.load_checkpoint on a one-rank stand-in unit), each
    rank file checked against its SHA-256 once (`verified`: those checked); keeps the units of the file being
    written, for weight_of."""

    def __init__(self, path: str, manifest: dict, verified: set):
        self.path, self.manifest, self.params = path, manifest, unit_params(manifest)
        self.unit_of = {p: unit for unit, params in self.params.items() for p, _ in params}
        self.verified, self.read = verified, {}

    def unit(self, name: str) -> dict:
        """{parameter name: its whole fp32 tensor} of unit `name`."""
        if name not in self.read:
            numel = self.manifest["units"][name]["numel"]
            one_rank = types.SimpleNamespace(name=name, numel=numel, shard_start=0, shard_numel=numel, trained=False,
                                             master_shard=torch.empty(numel), optimizer_state={}, optimizer_steps=0)
            checkpoints.load_checkpoint(self.path, self.manifest, [one_rank], master_only=True, verified=self.verified)
            pieces = one_rank.master_shard.split([math.prod(s) for _, s in self.params[name]])
            self.read[name] = {p: piece.view(s) for (p, s), piece in zip(self.params[name], pieces)}
        return self.read[name]

    def weight_of(self, param: str) -> torch.Tensor:
        return self.unit(self.unit_of[param])[param]


def export_tensors(reader: CheckpointReader, unit: str, dtype: torch.dtype) -> list:
    """[(Hugging Face name, tensor in `dtype`)] of one unit, as model.hf_tensors writes each parameter."""
    return [(name, t.to(dtype).clone()) for p, tensor in reader.unit(unit).items()
            for name, t in M.hf_tensors(p, tensor, reader.weight_of).items()]


def planned_files(manifest: dict, dtype: torch.dtype, shard_gb: float) -> list[tuple[str, list]]:
    """[(file name, its units)]: files of at most shard_gb by the units' sizes, so each can be named -0000i-of-0000n."""
    bytes_per, files, size = torch.tensor([], dtype=dtype).element_size(), [[]], 0
    for unit, saved in manifest["units"].items():
        if files[-1] and size + saved["numel"] * bytes_per > shard_gb * 1e9:
            files.append([])
            size = 0
        files[-1].append(unit)
        size += saved["numel"] * bytes_per
    if len(files) == 1:
        return [("model.safetensors", files[0])]
    return [(f"model-{i + 1:05d}-of-{len(files):05d}.safetensors", units) for i, units in enumerate(files)]


def write_part(checkpoint: str, manifest: dict, tmp: str, dtype: torch.dtype, shard_gb: float, part: int, parts: int,
               verified: set):
    """The weight files i with i % parts == part into `tmp`, one file's units in memory at a time."""
    reader = CheckpointReader(checkpoint, manifest, verified)
    for fname, units in planned_files(manifest, dtype, shard_gb)[part::parts]:
        tensors = [named for unit in units for named in export_tensors(reader, unit, dtype)]
        try:
            OD.write_safetensors_streaming(os.path.join(tmp, fname), tensors, metadata={"format": "pt"})
        except OSError as e:  # an fsync's error names no file: this one
            e.filename = e.filename or os.path.join(tmp, fname)
            raise
        reader.read.clear()


def finish(checkpoint: str, manifest: dict, out: str, dtype: torch.dtype, shard_gb: float, check: bool) -> str:
    """The weight files' index (from their headers), finish_export's files, then OUT.partial renamed to OUT.
    Returns the tokenizer note."""
    from safetensors import safe_open
    tmp, files = out.rstrip("/") + ".partial", planned_files(manifest, dtype, shard_gb)
    weight_map, shapes, total_bytes = {}, {}, 0
    for fname, _ in files:
        with safe_open(os.path.join(tmp, fname), framework="pt") as f:
            for name in f.keys():
                weight_map[name], shapes[name] = fname, tuple(f.get_slice(name).get_shape())
        total_bytes += os.path.getsize(os.path.join(tmp, fname))
    for stale in set(os.listdir(tmp)) - {fname for fname, _ in files}:  # a crashed attempt's, with another shard size
        os.remove(os.path.join(tmp, stale))
    if len(files) > 1:
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, f, indent=2)
    note = finish_export(tmp, M.ModelConfig(**manifest["model"]), dtype, hf.export_origin(manifest["train"]), shapes,
                         check)
    if os.path.isdir(out):
        os.rmdir(out)  # an empty folder (a non-empty one is refused first)
    os.replace(tmp, out)  # the folder appears complete or not at all
    OD.fsync_dir(os.path.dirname(os.path.abspath(out)))
    return note


def export(checkpoint: str, out: str, dtype: torch.dtype, shard_gb: float, part: int | None, parts: int,
           written_now: bool) -> str:
    """OUT from the checkpoint: all of it (`part` None), the weight files of one `part` of `parts` (the ranks of
    the run that saved it write theirs at once), or the rest once they are written (`part` -1, --finish).
    `written_now`: the checkpoint this run has just written and hashed as it wrote it, not hashed again (each
    part would hash every rank file: 12 B per parameter), of a model whose export the run checked before step 1
    (hf.check_export, the same model.hf_tensors): not checked again, which would import transformers. Returns the tokenizer note; raises CheckpointError
    (leaving no OUT.partial, but for a part's)."""
    manifest = OD.load_json(os.path.join(checkpoint, "manifest.json"))
    tmp = out.rstrip("/") + ".partial"
    verified = set(manifest["files"]) | {os.path.join("..", (manifest.get("frozen") or {}).get("folder", ""), name)
                                         for name in (manifest.get("frozen") or {}).get("files", {})} if written_now else set()
    try:
        if part is None:  # a crashed export's model.safetensors must not sit beside a new index
            shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp, exist_ok=part is not None)
        if part != -1:
            write_part(checkpoint, manifest, tmp, dtype, shard_gb, part or 0, parts, verified)
        return finish(checkpoint, manifest, out, dtype, shard_gb, not written_now) if part in (None, -1) else ""
    except (OSError, ValueError) as e:  # ValueError: check_export_tensors (transformers would build another model)
        if part in (None, -1):  # a part's failure leaves the others' files: the next attempt's finish clears them
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, ValueError):
            raise OD.CheckpointError(str(e)) from None
        raise OD.CheckpointError(f"--export_hf: cannot write {OD.write_error(tmp, e)}", e.errno or errno.EIO) from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint's step_* folder, or an --out_dir (its latest)")
    parser.add_argument("out", help="the Hugging Face folder to write (absent or empty)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    parser.add_argument("--shard_gb", type=float, default=5.0, help="largest safetensors file, in GB")
    parser.add_argument("--part", type=int, default=None, help="write only weight files i with i %% PARTS == PART")
    parser.add_argument("--parts", type=int, default=1)
    parser.add_argument("--finish", action="store_true", help="once every part is written: the rest, and the rename")
    parser.add_argument("--written_now", action="store_true", help="the checkpoint was hashed as it was written")
    parser.add_argument("--flag", default="--from_ckpt", help="what error lines call CHECKPOINT")
    args = parser.parse_args(argv)
    try:
        if OD.export_made(args.out):
            raise OD.CheckpointError(f"--export_hf: {args.out} exists and is not empty; remove it or choose another")
        path = checkpoints.find_checkpoint(args.checkpoint) if os.path.isdir(args.checkpoint) else None
        if path is None:
            raise OD.CheckpointError(f"{args.flag}: {args.checkpoint} is not one of our checkpoints (no manifest.json, "
                                     f"and no checkpoints/step_* folder in it)")
        manifest = OD.load_json(os.path.join(path, "manifest.json"))
        checkpoints.check_checkpoint_files(path, args.flag, {u: s["numel"] for u, s in manifest["units"].items()})
        if args.part is None and not args.finish and not args.written_now:
            print(f"read checkpoint {path} (step {manifest['step']})", flush=True)
        note = export(path, args.out, getattr(torch, args.dtype), args.shard_gb, -1 if args.finish else args.part,
                      args.parts, args.written_now)
    except (OD.CheckpointError, OSError, ValueError, KeyError, TypeError) as e:
        line = str(e) if isinstance(e, (OD.CheckpointError, OSError)) else f"{args.flag}: {type(e).__name__}: {e}"
        print(f"error: {line}", file=sys.stderr, flush=True)
        return exit_code(e)
    if args.part is None:  # all of it, or --finish
        print(f"exported a Hugging Face folder to {args.out} ({note})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
