"""grpo_testmodels: hub-free test models, their tokenizer, toy datasets and the demo reward's target range."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from grpo_api.fingerprint import model_fingerprint
from grpo_testmodels import PRESETS, SPECIAL_TOKENS, make_dataset, make_model, preset_config, target_token_ids
from grpo_testmodels.cli import make_model as make_model_cmd
from grpo_testmodels.dataset import vocabulary_words

#: Qwen2.5-1.5B has 1,543,714,304 parameters with a tied 151,936-entry vocabulary of width 1536.
QWEN25_15B_PARAMS = 1_543_714_304


def _files(model_dir: Path) -> dict[str, bytes]:
    return {p.relative_to(model_dir).as_posix(): p.read_bytes() for p in sorted(model_dir.rglob("*")) if p.is_file()}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny_seed1_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("seed1") / "tiny", preset="tiny", seed=1)


def test_tiny_model_and_tokenizer_load_with_auto_classes(tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(tok) == 512
    assert model.config.initializer_range == 0.2
    assert model.config.tie_word_embeddings is False
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (64, 2)
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert (tiny_model_dir / "generation_config.json").is_file()
    assert json.loads((tiny_model_dir / "generation_config.json").read_text())["eos_token_id"] == [2, 0]
    # Readable beyond the owner (when the umask allows): a server running as another user loads it.
    umask = os.umask(0)
    os.umask(umask)
    for path in tiny_model_dir.iterdir():
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path.name
    # initializer_range 0.2 is what makes the demo learnable; check the weights really got it.
    std = model.lm_head.weight.std().item()
    assert 0.15 < std < 0.25


def test_tokenizer_round_trips_text_and_keeps_specials_whole(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "def f(x):\n    return x  # héllo wörld ✓ 数字 \t<tag>\n\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges were learned, not just bytes
    assert tok.encode("<|im_start|>user", add_special_tokens=False)[0] == 1


def test_chat_template_renders_chatml(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    assert ids.count(1) == 3 and ids.count(2) == 2


def test_tiny_model_generates(tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    inputs = tok(["import os", "def main(): return"], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    out = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=True)
    assert out.shape == (2, inputs["input_ids"].shape[1] + 8)
    assert int(out.max()) < 512


def test_same_preset_and_seed_give_byte_identical_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = make_model(tmp_path / "again", preset="tiny", seed=0)
    first, second = _files(tiny_model_dir), _files(again)
    assert "model.safetensors" in first and "tokenizer.json" in first
    assert first.keys() == second.keys()
    assert [name for name in first if first[name] != second[name]] == []


def test_different_seed_changes_weights_not_tokenizer(tiny_model_dir: Path, tiny_seed1_dir: Path) -> None:
    a, b = _files(tiny_model_dir), _files(tiny_seed1_dir)
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]


def test_fingerprint_is_stable_across_builds_and_differs_between_seeds(
    tiny_model_dir: Path, tiny_seed1_dir: Path, tmp_path: Path
) -> None:
    again = make_model(tmp_path / "again", preset="tiny", seed=0)
    assert model_fingerprint(tiny_model_dir) == model_fingerprint(again)
    assert model_fingerprint(tiny_model_dir) != model_fingerprint(tiny_seed1_dir)


def test_make_model_refuses_non_empty_dir_unless_overwrite(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty"):
        make_model(tmp_path, preset="tiny")
    result = CliRunner().invoke(make_model_cmd, [str(tmp_path)])
    assert result.exit_code != 0
    assert "not empty" in result.output and "--force" in result.output
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_make_model_cli_force_replaces_model_files_and_keeps_others(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"stale shard")
    result = CliRunner().invoke(make_model_cmd, ["--preset", "tiny", "--seed", "3", "--force", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "model-00001-of-00002.safetensors").exists()
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    assert json.loads((tmp_path / "config.json").read_text())["grpo_testmodel"] == {
        "preset": "tiny",
        "seed": 3,
    }


def test_unknown_preset_is_rejected_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown preset 'huge'.*tiny"):
        preset_config("huge")


def test_qwen2_5_1_5b_preset_has_qwen_shape_and_parameter_count() -> None:
    import torch
    from transformers import Qwen2ForCausalLM

    config = preset_config("qwen2.5-1.5b")
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (1536, 8960, 28)
    assert (config.num_attention_heads, config.num_key_value_heads) == (12, 2)
    assert (config.max_position_embeddings, config.vocab_size) == (32768, 32_000)
    assert config.tie_word_embeddings is True
    assert config.initializer_range == 0.02
    assert PRESETS["qwen2.5-1.5b"].dtype == "bfloat16"
    assert config.rope_parameters["rope_theta"] == 1_000_000.0
    with torch.device("meta"):  # shapes only: no 1.5B weights are materialised
        model = Qwen2ForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == QWEN25_15B_PARAMS - (151_936 - 32_000) * 1536


def test_the_learning_preset_is_the_1_5b_shape_with_larger_embeddings_only() -> None:
    plain, learn = PRESETS["qwen2.5-1.5b"], PRESETS["qwen2.5-1.5b-learn"]
    assert preset_config("qwen2.5-1.5b-learn").to_diff_dict() == preset_config("qwen2.5-1.5b").to_diff_dict()
    assert (plain.embedding_init_range, learn.embedding_init_range) == (None, 0.1)


def test_embedding_init_range_scales_the_embedding_and_leaves_every_other_weight(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the learning preset does to the 1.5B shape, on the tiny one (a 1.5B build takes minutes)."""
    import dataclasses

    import torch
    from safetensors.torch import load_file

    monkeypatch.setitem(PRESETS, "tiny", dataclasses.replace(PRESETS["tiny"], embedding_init_range=2.0))
    make_model(tmp_path / "wide", preset="tiny", seed=0)
    wide = load_file(tmp_path / "wide" / "model.safetensors")
    plain = load_file(tiny_model_dir / "model.safetensors")
    assert wide.keys() == plain.keys()
    embedding = "model.embed_tokens.weight"
    assert abs(wide[embedding].float().std().item() - 2.0) < 0.1
    assert abs(plain[embedding].float().std().item() - 0.2) < 0.02
    assert abs(wide["lm_head.weight"].float().std().item() - 2.0) < 0.1  # untied: the output embedding too
    for name in plain.keys() - {embedding, "lm_head.weight"}:
        assert torch.equal(wide[name], plain[name]), name


def test_dataset_rows_are_vocabulary_words_and_deterministic(
    tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path
) -> None:
    words = set(vocabulary_words(tiny_model_dir))
    rows = _rows(tiny_dataset)
    assert len(rows) == 64
    for row in rows:
        prompt_words = row["prompt"].split(" ")
        assert 3 <= len(prompt_words) <= 6
        assert set(prompt_words) <= words
        assert row["answer"] == prompt_words[-1]
    again = make_dataset(tmp_path / "again.jsonl", tiny_model_dir)
    assert again.read_bytes() == tiny_dataset.read_bytes()
    other = make_dataset(tmp_path / "other.jsonl", tiny_model_dir, seed=99)
    assert other.read_bytes() != tiny_dataset.read_bytes()
    assert len(words) >= 50  # enough variety for 64 prompts


def test_conversational_dataset_wraps_the_same_prompts(tiny_dataset: Path, tiny_chat_dataset: Path) -> None:
    plain, chat = _rows(tiny_dataset), _rows(tiny_chat_dataset)
    assert [row["prompt"] for row in chat] == [[{"role": "user", "content": row["prompt"]}] for row in plain]
    assert [row["answer"] for row in chat] == [row["answer"] for row in plain]


def test_make_dataset_names_the_missing_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        make_dataset(tmp_path / "x.jsonl", tmp_path)
    assert not (tmp_path / "x.jsonl").exists()


def test_target_token_ids_cover_an_eighth_of_the_vocabulary_without_specials(tiny_model_dir: Path) -> None:
    lo, hi = target_token_ids(tiny_model_dir)
    assert hi - lo == 512 // 8
    assert 0 <= lo < hi <= 512
    assert not {0, 1, 2} & set(range(lo, hi))
