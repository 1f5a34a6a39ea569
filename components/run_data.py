"""A run's data from its flags: data.py reads tokens; here a run's --data and --eval_data meet its model
(open_data, with the built-in sample built first when --data is `sample`), and the other components learn
what --data names (sources; first_prepared_folder: where its tokenizer is recorded; run_tokenizer; resolved_mix:
its meaning). The built-in sample is built by its tool, tools/sample_corpus.py, in a subprocess (build_sample):
a run knows only where it lies (SAMPLE_SOURCES, sample_sources, sample_is_built), which the tool reads here."""
import dataclasses
import fractions
import hashlib
import os
import pathlib
import subprocess
import sys

import data as D

SAMPLE_SOURCES = (("messages", 0.6), ("docstrings", 0.4))  # the built-in sample's two sources and weights
SAMPLE_TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "sample_corpus.py")


def open_data(cfg, mcfg):
    """(the model config, the training windows, the held-out ones or None): MixedWindows over --data and
    --eval_data. A preset takes its vocabulary and BOS/EOS ids from the prepared data's tokenizer; a model from
    --init_from must match it."""
    if cfg.data == "sample":
        folder = os.path.join(cfg.out_dir, "sample")
        if not sample_is_built(folder):
            if os.environ.get("RANK", "0") == "0":
                print(f"building the built-in sample (corpus, tokenizer, shards) in {folder}", flush=True)
            build_sample(folder)  # every rank that finds it unbuilt: the first builds it, the others wait on its lock
    train_data = [(name, D.TokenData(path, "--data"), weight) for name, path, weight in sources(cfg, "--data")]
    held_out = sources(cfg, "--eval_data") if cfg.eval_every else []
    eval_data = [(name, D.TokenData(path, "--eval_data"), weight) for name, path, weight in held_out]
    first = next((data for _, data, _ in train_data if data.meta), None)  # it names the tokenizer
    if first and not cfg.init_from:  # a tokenizer without BOS (Qwen) leaves the model's
        mcfg = dataclasses.replace(mcfg, **{key: first.meta[key] for key in ("vocab_size", "bos_id", "eos_id")
                                            if first.meta[key] is not None})
    for _, data, _ in train_data + eval_data:  # bare token ids: a document starts after the model's EOS
        if data.meta is None:
            data.eos_id = mcfg.eos_id
    for _, data, _ in train_data + eval_data:  # one tokenizer for the whole run
        if first and data.meta and data.meta["tokenizer"]["sha256"] != first.meta["tokenizer"]["sha256"]:
            raise D.DataError(f"{data.flag}: {data.path} was tokenized with {data.meta['tokenizer']['path']}, --data "
                              f"{first.path} with {first.meta['tokenizer']['path']}: a run needs one tokenizer")
    if first and cfg.init_from and first.meta["tokenizer"]["kind"] == "huggingface":
        model_tokenizer = pathlib.Path(cfg.init_from, "tokenizer.json")  # hashed as meta.json's SHA-256 is
        if model_tokenizer.is_file() and (hashlib.sha256(model_tokenizer.read_bytes()).hexdigest()
                                          != first.meta["tokenizer"]["sha256"]):
            raise D.DataError(f"--data: {first.path} was tokenized with {first.meta['tokenizer']['path']}, whose "
                              f"tokenizer.json differs from {model_tokenizer}")
    return mcfg, mixed_windows(train_data, cfg, mcfg), mixed_windows(eval_data, cfg, mcfg) if eval_data else None


def sample_sources(out_dir: str, part: str) -> list[tuple[str, str, fractions.Fraction]]:
    """The built-in sample's sources: OUT_DIR/sample/{train,eval}/NAME with SAMPLE_SOURCES' weights."""
    return [(name, os.path.join(out_dir, "sample", part, name), fractions.Fraction(str(weight)))
            for name, weight in SAMPLE_SOURCES]


def sample_is_built(folder: str) -> bool:
    """Whether each source's train and eval folders are complete (meta.json is written last)."""
    return all(os.path.isfile(os.path.join(folder, part, name, "meta.json"))
               for name, _ in SAMPLE_SOURCES for part in ("train", "eval"))


def build_sample(folder: str):
    """The built-in sample in `folder`, built by SAMPLE_TOOL in a subprocess: the tool holds the folder's lock
    while it builds, so a rank that starts it while another builds waits, then finds it built. Its warnings
    are passed on; its error (its last line) is this run's."""
    proc = subprocess.run([sys.executable, SAMPLE_TOOL, folder, "--quiet"], stderr=subprocess.PIPE, text=True)
    lines = proc.stderr.splitlines()
    if proc.returncode == 0:
        sys.stderr.write(proc.stderr)
        return
    sys.stderr.write("".join(line + "\n" for line in lines[:-1]))
    why = lines[-1].removeprefix("error: ") if lines else f"{SAMPLE_TOOL} exited with {proc.returncode}"
    raise D.DataError(f"--data sample: could not build the built-in sample in {folder}: {why}")


def sources(cfg, flag: str) -> list[tuple[str, str, fractions.Fraction]]:
    """[(name, path, weight)] of --data or --eval_data (`flag`): the built-in sample's (for --eval_data auto too,
    with --data sample: its held-out part), else the flag's own; none for --eval_data auto or ''."""
    spec = cfg.data if flag == "--data" else cfg.eval_data
    if spec == "sample" or spec == "auto" and cfg.data == "sample":
        return sample_sources(cfg.out_dir, "train" if flag == "--data" else "eval")
    return [] if flag == "--eval_data" and spec in ("auto", "") else D.parse_sources(spec, flag)


def mixed_windows(opened: list, cfg, mcfg) -> D.MixedWindows:
    """The MixedWindows of [(name, TokenData, weight)], each source's ids checked against the vocabulary."""
    for _, data, _ in opened:
        data.check_vocab(mcfg.vocab_size)
    return D.MixedWindows([name for name, _, _ in opened],
                          [D.TokenWindows(data, cfg.seq_len, cfg.seed) for _, data, _ in opened],
                          [weight for _, _, weight in opened])


def first_prepared_folder(spec: str, out_dir: str) -> str | None:
    """The first source of --data that is a prepared folder (its meta.json names the tokenizer), or None."""
    if spec == "sample":
        return sample_sources(out_dir, "train")[0][1]
    paths = [D.split_source(item)[0] for item in spec.split(",")]
    return next((path for path in paths if os.path.isfile(os.path.join(path, "meta.json"))), None)


def run_tokenizer(cfg) -> str | None:
    """The tokenizer of this run's token ids: the one --data was prepared with (its meta.json's; the
    built-in sample's OUT_DIR/sample/tokenizer.model, built at set-up), else --init_from's tokenizer.json;
    None for a bare .npy without either. Raises DataError for a prepared folder whose meta.json is bad."""
    if cfg.data == "sample":
        return os.path.join(cfg.out_dir, "sample", "tokenizer.model")
    folder = first_prepared_folder(cfg.data, cfg.out_dir)  # a mix's sources share one tokenizer
    if folder:
        return D.read_meta(folder, "--data")["tokenizer"]["path"]
    if cfg.init_from and os.path.isfile(os.path.join(cfg.init_from, "tokenizer.json")):
        return cfg.init_from
    return None


def resolved_mix(spec: str, flag: str) -> list[list[str]]:
    """What a mix means, however it is written: [real path, normalised weight] per source, in order, so
    `fr:3,en:2` and `./fr/:0.6,/abs/en:0.4` are alike, but not `en:0.4,fr:0.6` (MixedWindows.counts rounds
    in order). Weights stay exact fractions: a float tolerance would pass a weight the schedule tells apart."""
    sources = D.parse_sources(spec, flag)
    total = sum(weight for _, _, weight in sources)
    return [[os.path.realpath(path), str(weight / total)] for _, path, weight in sources]
