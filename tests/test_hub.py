"""Models by Hugging Face Hub id, offline, from a cache this test writes in the Hub's own layout.

The layout is checked with huggingface_hub's own readers (``scan_cache_dir``, ``try_to_load_from_cache``); every
command run by id must give what the same command gives on the snapshot folder huggingface_hub names. No test asks
the Hub: HF_HUB_OFFLINE is set in the environment and in ``huggingface_hub.constants`` (read once at import).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants, scan_cache_dir, try_to_load_from_cache
from safetensors.torch import load_file

import entrenar
from conftest import make_hf_model, make_workspace
from entrenar.errors import ModelError
from entrenar.io import hub

IDS = torch.tensor([[3, 7, 11, 2, 5]])
CPU = ("--device", "cpu")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache that huggingface_hub and entrenar use, offline; the working folder a project folder."""
    folder = tmp_path / "hf-cache"
    folder.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "_resolved", {})
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    return folder


def publish(cache: Path, repo: str, folder: Path, ref: str = "main") -> str:
    """Put ``folder``'s files in ``cache`` as the Hub does: content-addressed blobs, a snapshot of symlinks named
    by the commit, and ``refs/<ref>`` holding the commit hash. Returns the commit hash."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    commit = hashlib.sha1(b"".join(p.relative_to(folder).as_posix().encode() + p.read_bytes()
                                   for p in files)).hexdigest()
    root = cache / ("models--" + repo.replace("/", "--"))
    for file in files:
        data = file.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = root / "snapshots" / commit / file.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return commit


def snapshot(repo: str, file: str = "config.json", revision: str | None = None) -> Path:
    """The snapshot folder huggingface_hub finds in the cache for ``repo`` (its own reader, not ours)."""
    found = try_to_load_from_cache(repo, file, revision=revision)
    assert isinstance(found, str), f"huggingface_hub finds no cached {file} of {repo}: {found!r}"
    return Path(found).parent


def logits(path, **kwargs) -> torch.Tensor:
    model, _ = entrenar.load(path, device="cpu", dtype=torch.float32, **kwargs)
    with torch.no_grad():
        return model(IDS)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    from entrenar.cli.main import main

    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def tiny(cache, tmp_path) -> str:
    """conftest's workspace model (a character tokenizer) published as ``org/tiny``; its data in the project."""
    ws = make_workspace(tmp_path / "ws")
    shutil.copy(ws / "train.jsonl", "train.jsonl")
    publish(cache, "org/tiny", ws / "model")
    return "org/tiny"


def test_the_cache_is_in_the_hubs_layout_and_an_id_resolves_to_its_snapshot(tiny, cache):
    info = scan_cache_dir(cache)
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert (repo.repo_id, repo.repo_type) == ("org/tiny", "model")
    (revision,) = repo.revisions
    assert revision.refs == frozenset({"main"}) and {f.file_name for f in revision.files} >= {
        "config.json", "model.safetensors", "tokenizer.json"}
    assert hub.resolve(tiny) == snapshot(tiny) == revision.snapshot_path
    assert torch.equal(logits(tiny), logits(snapshot(tiny)))


def test_a_local_path_wins_over_an_id(tiny, tmp_path):
    other = tmp_path / "other"
    make_hf_model("llama", seed=5).save_pretrained(other)
    shutil.copytree(other, "org/tiny")  # ./org/tiny exists here: it is what "org/tiny" means
    assert hub.resolve("org/tiny") == Path("org/tiny")
    assert torch.equal(logits("org/tiny"), logits(other))


def test_train_eval_generate_and_export_by_id(tiny, capsys):
    Path("recipe.yaml").write_text(f"""
model: {{path: {tiny}, device: cpu}}
data: {{train: train.jsonl, seq_len: 32, validation_split: 0.2, train_on: completion, add_eos: false}}
lora: {{r: 4, alpha: 8, dropout: 0.0, target_modules: all-linear}}
optimizer: {{lr: 1.0e-2}}
schedule: {{warmup_steps: 1}}
training: {{max_steps: 3, batch_size: 2, eval_every: 3, save_every: 3, log_every: 1}}
output: {{dir: runs/lora}}
""")
    code, _, err = run_cli(capsys, "train", "recipe.yaml", "--no-progress")
    assert code == 0, err
    adapter = Path("runs/lora/adapter")
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == tiny
    local = snapshot(tiny)

    for model, extra in ((tiny, ["--adapter", adapter]), ("runs/lora", [])):  # the run: its base is the id
        code, out, err = run_cli(capsys, "eval", model, *extra, "--data", "train.jsonl", *CPU)
        assert code == 0, err
        assert out == run_cli(capsys, "eval", local, "--adapter", adapter, "--data", "train.jsonl", *CPU)[1]
        code, out, err = run_cli(capsys, "generate", model, *extra, "--prompt", "3+4=", "--max-new-tokens", 4, *CPU)
        assert code == 0, err
        assert out == run_cli(capsys, "generate", local, "--adapter", adapter, "--prompt", "3+4=",
                              "--max-new-tokens", 4, *CPU)[1]

    code, _, err = run_cli(capsys, "export", tiny, "--adapter", adapter, "--merge", "--output", "by-id")
    assert code == 0, err
    run_cli(capsys, "export", local, "--adapter", adapter, "--merge", "--output", "by-path")
    by_id, by_path = load_file("by-id/model.safetensors"), load_file("by-path/model.safetensors")
    assert by_id.keys() == by_path.keys() and all(torch.equal(by_id[k], by_path[k]) for k in by_id)


def test_an_adapter_by_id(tiny, cache, tmp_path):
    from entrenar.adapters.lora import LoraConfig, apply_lora, save_adapter

    model, _ = entrenar.load(tiny, device="cpu")
    apply_lora(model, LoraConfig(r=2, alpha=4, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    save_adapter(model, tmp_path / "adapter", LoraConfig(r=2, alpha=4, target_modules=["q_proj", "v_proj"]),
                 base_model_name_or_path=tiny)
    publish(cache, "org/tiny-lora", tmp_path / "adapter")
    expected = logits(tiny, adapter=tmp_path / "adapter")
    assert not torch.equal(expected, logits(tiny))  # the adapter changes the outputs
    assert torch.equal(logits(tiny, adapter="org/tiny-lora"), expected)
    assert torch.equal(logits("org/tiny-lora"), expected)  # alone: its base is the id its config names


def perturbed_copy(tmp_path, seed: int) -> Path:
    """tmp_path/v2: a model of the workspace's shape with other weights, and its tokenizer (a later revision)."""
    from entrenar.models.hf import save_hf

    newer = make_workspace(tmp_path / "ws2")
    torch.manual_seed(seed)
    model, tokenizer = entrenar.load(newer / "model", device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_hf(model, tmp_path / "v2")
    tokenizer.save(tmp_path / "v2")
    return tmp_path / "v2"


def test_a_revision_other_than_main(tiny, cache, tmp_path):
    perturbed_copy(tmp_path, seed=3)
    commit = publish(cache, tiny, tmp_path / "v2", ref="v2")
    main, v2 = logits(tiny), logits(tmp_path / "v2")
    assert not torch.equal(main, v2)
    assert hub.resolve(f"{tiny}@v2") == snapshot(tiny, revision="v2") != snapshot(tiny)
    assert torch.equal(logits(f"{tiny}@v2"), v2)
    assert torch.equal(logits(f"{tiny}@{commit}"), v2)  # a commit hash
    assert torch.equal(logits(f"{tiny}@main"), main)
    assert {r.commit_hash for r in next(iter(scan_cache_dir(cache).repos)).revisions} == {
        commit, hub.resolve(tiny).name}


def test_an_adapter_on_a_revision_names_it_as_peft_does(tiny, cache, tmp_path):
    import peft

    from entrenar.adapters.lora import LoraConfig, apply_lora, save_adapter

    perturbed_copy(tmp_path, seed=4)
    publish(cache, tiny, tmp_path / "v2", ref="v2")
    cfg = LoraConfig(r=2, alpha=4, target_modules=["q_proj"])
    model, _ = entrenar.load(f"{tiny}@v2", device="cpu")
    apply_lora(model, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    save_adapter(model, tmp_path / "adapter", cfg, base_model_name_or_path=f"{tiny}@v2")
    read = peft.PeftConfig.from_pretrained(tmp_path / "adapter")
    assert (read.base_model_name_or_path, read.revision) == (tiny, "v2")
    assert torch.equal(logits(tmp_path / "adapter"), logits(tmp_path / "v2", adapter=tmp_path / "adapter"))


def test_merge_inputs_and_base_model_by_id(cache, tmp_path, capsys):
    from entrenar import quickstart

    tokenizer = quickstart.build_tokenizer()
    for seed, name in enumerate(("base", "a", "b")):
        make_hf_model("llama", seed=seed, vocab_size=tokenizer.vocab_size).save_pretrained(tmp_path / name)
        tokenizer.save(tmp_path / name)
        publish(cache, f"org/{name}", tmp_path / name)
    config = """merge_method: task_arithmetic
base_model: {base}
models:
  - model: {a}
    parameters: {{weight: 0.7}}
  - model: {b}
    parameters: {{weight: 0.4}}
tokenizer_source: {a}
"""
    Path("by-id.yaml").write_text(config.format(base="org/base", a="org/a", b="org/b"))
    Path("by-path.yaml").write_text(config.format(**{n: snapshot(f"org/{n}") for n in ("base", "a", "b")}))
    code, _, err = run_cli(capsys, "merge", "by-id.yaml", "--output", "by-id", "--quiet")
    assert code == 0, err
    run_cli(capsys, "merge", "by-path.yaml", "--output", "by-path", "--quiet")
    by_id, by_path = load_file("by-id/model.safetensors"), load_file("by-path/model.safetensors")
    assert by_id.keys() == by_path.keys() and all(torch.equal(by_id[k], by_path[k]) for k in by_id)
    base, a = load_file(tmp_path / "base/model.safetensors"), load_file(tmp_path / "a/model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(by_id[name], base[name]) and not torch.equal(by_id[name], a[name])


def test_an_uncached_id_offline_is_refused_naming_the_id_revision_and_cache(cache, capsys):
    with pytest.raises(ModelError) as e:
        entrenar.load("org/missing@v1")
    assert "org/missing@v1 (revision v1)" in str(e.value) and str(cache) in str(e.value)
    assert "HF_HUB_OFFLINE" in str(e.value) and "hf download org/missing --revision v1" in str(e.value)
    code, out, err = run_cli(capsys, "generate", "org/missing", "--prompt", "hi")
    assert (code, out) == (2, "")
    assert err.startswith("error: org/missing (revision main): ") and str(cache) in err and "Traceback" not in err

    Path("train.jsonl").write_text('{"text": "hello"}\n')
    Path("recipe.yaml").write_text("model: {path: org/missing}\ndata: {train: train.jsonl}\noutput: {dir: runs/x}\n")
    code, _, err = run_cli(capsys, "train", "recipe.yaml", "--no-progress")
    assert code == 2 and "org/missing (revision main)" in err and "Traceback" not in err
    assert not Path("runs").exists()  # refused before anything was written

    Path("merge.yaml").write_text("merge_method: linear\nmodels:\n  - model: org/missing\n  - model: org/other\n")
    code, _, err = run_cli(capsys, "merge", "merge.yaml", "--output", "out")
    assert code == 2 and "merge.yaml" in err and "line 3" in err and "org/missing" in err


@pytest.mark.parametrize(("name", "message"), [
    ("", "a model name is empty"),
    ("a/b/c/d", "a/b/c/d: no such local file or folder, and not a Hugging Face Hub id (4 parts"),
    ("org/name@", "nothing follows '@'"),
    ("org//name", "an empty part"),
    ("org/na--me", "not a Hugging Face Hub id"),
])
def test_malformed_ids_are_named(cache, capsys, name, message):
    with pytest.raises(ModelError, match=message.replace("(", r"\(")):
        hub.resolve(name)
    code, _, err = run_cli(capsys, "generate", name, "--prompt", "hi")
    assert code == 2 and message in err and "Traceback" not in err


def test_names_written_as_paths_are_not_ids(cache):
    for name in ("./org/name", "/abs/org/name", "~/org/name", "folder", "models/file.gguf"):
        assert hub.parse_hub_id(name) is None
    assert hub.parse_hub_id("org/name-GGUF/sub/m-Q4_K.gguf@v1") == hub.HubId("org/name-GGUF", "v1", "sub/m-Q4_K.gguf")


@pytest.mark.parametrize(("recipe", "repo", "family"), [
    ("lora-llama", "meta-llama/Llama-3.2-1B", "llama"),
    ("moe-qwen3-lora", "Qwen/Qwen3-30B-A3B", "qwen3_moe"),
])
def test_the_bundled_recipes_run_by_the_hub_ids_they_name(cache, tmp_path, capsys, recipe, repo, family):
    """A tiny model of the same family stands in for the named one in the cache; the recipe runs as shipped."""
    from entrenar import quickstart
    from entrenar.config import load_recipe

    root = Path(__file__).resolve().parents[1] / "recipes" / f"{recipe}.yaml"
    assert load_recipe(root).model.path == repo
    tokenizer = quickstart.build_tokenizer()
    make_hf_model(family, vocab_size=tokenizer.vocab_size).save_pretrained(tmp_path / "tiny")
    tokenizer.save(tmp_path / "tiny")
    publish(cache, repo, tmp_path / "tiny")
    shutil.copy(make_workspace(tmp_path / "ws") / "train.jsonl", "train.jsonl")
    small = ["data.train=train.jsonl", "data.seq_len=32", "training.max_steps=1", "training.batch_size=2",
             "training.grad_accum=1", "training.precision=fp32", "schedule.warmup_steps=0", "model.device=cpu",
             "model.dtype=float32", "output.dir=runs/x"]
    code, _, err = run_cli(capsys, "train", root, "--no-progress", *(a for s in small for a in ("--set", s)))
    assert code == 0, err
    adapter = json.loads(Path("runs/x/adapter/adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == repo


def test_inspect_and_quantize_by_id(tiny, capsys):
    local = snapshot(tiny)
    code, out, err = run_cli(capsys, "inspect", tiny)
    assert code == 0, err
    assert out.replace(tiny, "M") == run_cli(capsys, "inspect", local)[1].replace(str(local), "M")
    for name, model in (("by-id", tiny), ("by-path", local)):
        code, _, err = run_cli(capsys, "quantize", model, "--method", "int8", "--output", name)
        assert code == 0, err
    by_id, by_path = load_file("by-id/model.safetensors"), load_file("by-path/model.safetensors")
    assert by_id.keys() == by_path.keys() and all(torch.equal(by_id[k], by_path[k]) for k in by_id)


def test_one_gguf_file_of_a_repository(cache, tmp_path):
    from gguf_fixtures import byte_level_vocab, train_byte_level_tokenizer, write_gguf

    tokenizer = train_byte_level_tokenizer("smollm")
    vocab_size = tokenizer.get_vocab_size() + 15
    model = make_hf_model("llama", vocab_size=vocab_size)
    (tmp_path / "repo").mkdir()
    write_gguf(tmp_path / "repo" / "tiny-F32.gguf", model, vocab=byte_level_vocab(tokenizer, vocab_size),
               special_ids={"bos": 1, "eos": 2})
    publish(cache, "org/tiny-GGUF", tmp_path / "repo")
    found = try_to_load_from_cache("org/tiny-GGUF", "tiny-F32.gguf")
    assert hub.resolve("org/tiny-GGUF/tiny-F32.gguf") == Path(found)
    assert torch.equal(logits("org/tiny-GGUF/tiny-F32.gguf"), logits(tmp_path / "repo" / "tiny-F32.gguf"))
    with pytest.raises(ModelError, match="no file other.gguf in the snapshot .*HF_HUB_OFFLINE"):
        hub.resolve("org/tiny-GGUF/other.gguf")


def test_a_random_init_models_tokenizer_by_id(tiny):
    from types import SimpleNamespace

    from entrenar.data.tokenizer import Tokenizer
    from entrenar.models.random_init import load_tokenizer

    by_id = load_tokenizer(SimpleNamespace(model=SimpleNamespace(tokenizer=tiny)))
    assert by_id.encode("12+7=") == Tokenizer.from_folder(snapshot(tiny)).encode("12+7=")
    assert by_id.vocab_size == Tokenizer.from_folder(snapshot(tiny)).vocab_size


def test_a_missing_folder_inside_a_local_folder_is_not_asked_of_the_hub(cache, tmp_path, monkeypatch):
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hub, "fetch", lambda hub_id: pytest.fail(f"asked the Hub for {hub_id}"))
    assert hub.resolve("runs/my-rn") == Path("runs/my-rn")  # a typo of runs/my-run: "no such model folder" follows
