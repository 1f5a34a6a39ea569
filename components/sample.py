"""Samples while training: `--sample_prompts FILE` makes each evaluation also complete a few prompts
greedily (`--sample_tokens` new tokens at most), print them, and append them to OUT_DIR/samples.jsonl.

The prompts: .jsonl, `{"text": ...}` or a chat `{"messages": [...]}`, rendered as the run's tokenizer
(run_data.run_tokenizer's) renders them. The tokenizer is a tool's, tools/tokenizer.py, which the trainer never
imports: rank 0 asks it once, in a subprocess, for the prompts' ids and the ids that end a completion
(encode_prompts), and every rank runs rank 0's answer; rank 0 decodes the completions with the tokenizer's own
library (load_decoder). The sampled ids are broadcast from rank 0 each step so that all ranks agree on when to
stop (a rank that stopped early would leave the others waiting in a gather).

Generation through the sharded model: each pass over the model (the prompts' prefill, then one new
token per prompt) gathers every unit once, just before it runs and freed right after, as training's
forward does (train.py section 2), and runs all the prompts through it one after the other, each with its
own KV cache (model.KVCache, one per block and prompt). No padding and no mask, so each prompt computes
exactly what it would alone; the gathers, which cost the most at scale (the whole model per pass,
plan.sampling_time), are shared by all prompts. The caches live only inside generate(). None of this
is on the training step's path: train.py calls Sampler.sample after an evaluation's metrics line.
"""
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import data as D
import model as M
from components import flags, hf, out_dir as OD
from components import run_data

TOKENIZER_TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "tokenizer.py")
TOKENIZER_TIMEOUT_S = 300  # under --timeout_min's default: a hung tool is rank 0's error line, not a collective's


def encode_prompts(tokenizer: str, records: list[dict]) -> dict:
    """TOKENIZER_TOOL's `prompts` answer for `records` with `tokenizer`: {"prompt_ids", "end_ids", "decoder"}, or
    {"error": its last line}. The records go as .jsonl on its stdin, the answer comes as JSON on its stdout."""
    try:
        proc = subprocess.run([sys.executable, TOKENIZER_TOOL, "prompts", "--tokenizer", tokenizer],
                              input="".join(json.dumps(r) + "\n" for r in records), text=True, capture_output=True,
                              timeout=TOKENIZER_TIMEOUT_S)
        if proc.returncode == 0:
            return json.loads(proc.stdout)
        why = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1].removeprefix("error: ")
    except (OSError, subprocess.SubprocessError, ValueError) as e:  # ValueError: JSON that does not parse
        why = f"{TOKENIZER_TOOL} failed ({type(e).__name__}: {e})"
    return {"error": why}


def load_decoder(kind: str, path: str):
    """What turns a completion's ids into text, as tools/tokenizer.py's Tokenizer.decode does: sentencepiece's
    processor for a .model, transformers' tokenizer for a folder (the tool's answer names which)."""
    if kind == "sentencepiece":
        import sentencepiece
        return sentencepiece.SentencePieceProcessor(model_file=path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def end_ids(cfg, mcfg: M.ModelConfig, tokenizer_end_ids: list[int]) -> list[int]:
    """The ids a completion stops at: the model's end of text (its config, and --init_from's
    generation_config.json list: Llama 3.1 Instruct ends a reply with <|eot_id|> or <|eom_id|>), and the
    tokenizer's (Tokenizer.end_ids: its end of text, its eos_token, the markers that close a chat turn)."""
    ids = {mcfg.eos_id, *tokenizer_end_ids}
    for name in ("config.json", "generation_config.json"):
        eos = (hf.source_json(cfg.init_from, name) or {}).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos])
    return sorted(i for i in ids if isinstance(i, int) and 0 <= i < mcfg.vocab_size)


def generate(sharded, prompts: list[list[int]], max_new_tokens: int, stop_ids) -> list[list[int]]:
    """Greedy completions of `prompts` (token ids) through the sharded model, every rank taking part:
    each a list of at most max_new_tokens ids, ending with the stop id when one came."""
    mcfg, dtype, device = sharded.model.cfg, sharded.compute_dtype, sharded.device
    caches = {i: [M.KVCache(len(p) + max_new_tokens, mcfg, dtype, device) for _ in range(mcfg.n_layers)]
              for i, p in enumerate(prompts)}
    feed = dict(enumerate(prompts))  # what each unfinished prompt feeds next: itself, then its last token
    completions = [[] for _ in prompts]
    with torch.no_grad():
        while feed:
            next_ids = forward_pass(sharded, [feed[i] for i in feed], [caches[i] for i in feed])
            dist.broadcast(next_ids, src=0)  # one decision on every rank
            for i, token in zip(list(feed), next_ids.tolist()):
                completions[i].append(token)
                feed[i] = [token]
                if token in stop_ids or len(completions[i]) == max_new_tokens:
                    del feed[i], caches[i]
    return completions


def forward_pass(sharded, inputs: list[list[int]], caches: list[list[M.KVCache]]) -> torch.Tensor:
    """One pass over the model (the module docstring) for every sequence: `inputs[j]` are sequence j's new tokens,
    `caches[j]` its blocks' caches (extended here); returns the greedy next id of each, (len(inputs),) int64."""
    model, device = sharded.model, sharded.device
    stages = [stage.forward_units for stage in sharded.stages]  # the embedding, each block, the head
    rope = []
    for ids, cache in zip(inputs, caches):
        start = cache[0].length
        positions = torch.arange(start, start + len(ids), device=device)[None]
        rope.append(M.rope_cos_sin(model.cfg, positions, sharded.compute_dtype))
    xs = [M.to_device(np.array([ids]), device) for ids in inputs]
    for k, stage in enumerate(stages):
        for unit in stage:
            unit.wait_gather()
            unit.set_views(unit.gathered)
        if sharded.prefetch and k + 1 < len(stages):
            for unit in stages[k + 1]:
                unit.start_gather()
        if k == 0:
            xs = [model.embed(x) for x in xs]
        elif k < len(stages) - 1:
            xs = [model.layers[k - 1](x, cos, sin, cache=cache[k - 1]) for x, (cos, sin), cache in zip(xs, rope, caches)]
        else:
            logits = torch.cat([model.logits(x[:, -1]) for x in xs])  # the last position's only
        for unit in stage:
            unit.free()
    return logits.float().argmax(-1)


def shorten(text: str, limit: int = 100) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[:limit - 3] + "..."


class Sampler:
    """--sample_prompts: the prompts as token ids, the ids that end a completion, and samples.jsonl. Made once the
    group exists: rank 0's encode_prompts answer goes to every rank (as JSON: nothing a peer sends is unpickled), so
    a failure stops each with the same line."""

    def __init__(self, cfg, mcfg: M.ModelConfig, rank: int, start_step: int, device):
        self.rank, self.max_new_tokens = rank, cfg.sample_tokens
        self.records = flags.read_prompts(cfg.sample_prompts)
        self.tokenizer_path = run_data.run_tokenizer(cfg)
        encoded = OD.gather_json(encode_prompts(self.tokenizer_path, self.records) if rank == 0 else None, device)[0]
        if "error" in encoded:
            raise D.DataError(f"--sample_prompts: {cfg.sample_prompts}: {encoded['error']}")
        self.prompts = encoded["prompt_ids"]
        for n, ids in enumerate(self.prompts, 1):
            if max(ids) >= mcfg.vocab_size:
                raise D.DataError(f"--sample_prompts: {cfg.sample_prompts}: prompt {n} encodes to id {max(ids)} "
                                  f"with {self.tokenizer_path}, outside the model's vocabulary [0, {mcfg.vocab_size})")
        self.stop_ids = end_ids(cfg, mcfg, encoded["end_ids"])
        self.decoder = load_decoder(*encoded["decoder"]) if rank == 0 else None  # only rank 0 writes the samples
        self.path = os.path.join(cfg.out_dir, "samples.jsonl")
        self.error = ""  # rank 0: why samples.jsonl cannot be written; train.py stops every rank on it
        self.error_cause = None  # the OSError behind it, for processes.exit_code
        if rank == 0:
            try:
                OD.keep_rows_up_to(self.path, start_step)
            except OSError as e:
                self.error, self.error_cause = OD.unwritable(self.path, e), e

    def sample(self, sharded, step: int):
        """Completes every prompt; rank 0 prints them and appends them to samples.jsonl with the step."""
        t0 = time.perf_counter()
        completions = generate(sharded, self.prompts, self.max_new_tokens, set(self.stop_ids))
        if self.rank != 0:
            return
        rows = [dict(step=step, prompt=record.get("text", record.get("messages")),
                     completion=self.decoder.decode(ids[:-1] if ids[-1] in self.stop_ids else ids), ids=ids)
                for record, ids in zip(self.records, completions)]
        try:
            with os.fdopen(OD.open_no_follow(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a") as f:
                f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        except OSError as e:  # a torn last line is dropped on resume (out_dir.keep_rows_up_to); `with` closed the file
            self.error, self.error_cause = OD.unwritable(self.path, e), e
        print(f"samples at step {step} ({len(rows)} prompts, {time.perf_counter() - t0:.1f} s, {self.path}):", flush=True)
        for row in rows:
            prompt = row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1]["content"]
            print(f"  {shorten(prompt)!r} -> {shorten(row['completion'])!r}", flush=True)

