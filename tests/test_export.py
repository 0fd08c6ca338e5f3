"""export.py hands a trained model to transformers unchanged (logits, greedy and beam outputs through the exported
tokenizer, template and generation_config.json), init_from=<export> trains on from it, and an export that cannot be
written is refused in one line and replaces nothing."""
import os
import types
from contextlib import nullcontext

import pytest
import torch
from transformers import GenerationConfig, GPT2LMHeadModel, GPT2TokenizerFast

import data
import export
import train
from config import load_config
from conftest import REPO, card_code, metrics, save_csv, synthetic_rows, tiny
from summarizer import inference
from summarizer.checkpoint import load_checkpoint
from summarizer.loading import build_model
from test_tokenizer import TEXTS

pytestmark = pytest.mark.slow  # every test uses a model trained 60 steps

# decoding settings that transformers' defaults do not have, so generate() only matches if the export carries them
DECODING = ["--max_new_tokens=20", "--repetition_penalty=1.3", "--no_repeat_ngram_size=3"]
MODEL = [*tiny(n_embd=64, max_new_tokens=None), "--batch_size=16", "--micro_batch_size=16", "--warmup_iters=5",
         "--learning_rate=1e-2", "--log_interval=1", *DECODING]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny model trained 60 steps, and its export."""
    folder = tmp_path_factory.mktemp("export")
    save_csv(folder / "train.csv", synthetic_rows(64, seed=0))
    save_csv(folder / "validation.csv", synthetic_rows(24, seed=3))
    args = [*MODEL, f"--train_csv={folder / 'train.csv'}", f"--validation_csv={folder / 'validation.csv'}",
            f"--data_cache_dir={folder / 'cache'}", f"--out_dir={folder / 'out'}"]
    train.main([*args, "--max_iters=60", "--eval_interval=30", "--rouge_samples=4"])
    export.main([f"--ckpt={folder / 'out' / 'best.pt'}", f"--export_dir={folder / 'hf'}"])
    ckpt = load_checkpoint(str(folder / "out" / "best.pt"))
    return types.SimpleNamespace(folder=folder, args=args, ckpt=ckpt, hf_dir=str(folder / "hf"),
                                 model=build_model(str(folder / "out" / "best.pt"))[0].eval(),
                                 cfg=load_config([*args, "--max_iters=40"]))


def hf_summaries(path, dialogues):
    """What a transformers user gets: the exported tokenizer and the card's code, generate() with no settings."""
    summarize = card_code(path)["summarize"]
    with torch.no_grad():
        return [summarize(dialogue) for dialogue in dialogues]


def test_exported_logits_equal_ours(run):
    hf = GPT2LMHeadModel.from_pretrained(run.hf_dir).eval()
    assert hf.config.n_positions == run.model.config.block_size == 128
    idx = torch.randint(0, 50257, (3, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, run.model(idx)[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(hf.lm_head.weight, hf.transformer.wte.weight)


@pytest.mark.parametrize("overrides", [[], ["--num_beams=3", "--length_penalty=0.6"], ["--min_new_tokens=12"]],
                         ids=["greedy", "beam", "min_new_tokens"])
def test_transformers_generate_with_the_exported_settings_equals_ours(run, overrides, tmp_path):
    path = run.hf_dir
    if overrides:  # decoding keys given to export.py replace the run's
        path = str(tmp_path / "beam")
        export.main([f"--ckpt={run.folder / 'out' / 'best.pt'}", f"--export_dir={path}", *overrides])
    dialogues = [row["dialogue"] for row in synthetic_rows(16, seed=7)]
    cfg = load_config([*run.args, *overrides])
    prompts, _ = inference.SummaryModel(run.model, cfg).prompts(dialogues)
    ours = inference.summarize_batches(run.model, prompts, cfg, nullcontext())
    assert len(set(ours)) > 4, ours  # a model that learned something, not one repeated string
    assert hf_summaries(path, dialogues) == ours
    settings = GenerationConfig.from_pretrained(path)  # older transformers leave default values out of the file
    assert settings.max_new_tokens == 20 and settings.no_repeat_ngram_size == 3
    assert settings.num_beams == (3 if "--num_beams=3" in overrides else 1) and settings.do_sample is False
    assert settings.min_new_tokens == (12 if "--min_new_tokens=12" in overrides else None)


def test_exported_tokenizer_encodes_like_ours(run):
    tokenizer = GPT2TokenizerFast.from_pretrained(run.hf_dir)
    enc = data.get_tokenizer()
    for text in [*TEXTS, "a <|endoftext|> b", run.cfg.prompt_template]:
        ids = tokenizer(text)["input_ids"]
        assert ids == enc.encode_ordinary(text), text
        assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == data.EOT_ID
    assert tokenizer.padding_side == "left"
    for name in ("vocab.json", "merges.txt"):
        assert os.path.isfile(os.path.join(run.hf_dir, name))
    umask = os.umask(0)
    os.umask(umask)
    modes = {name: os.stat(os.path.join(run.hf_dir, name)).st_mode & 0o777 for name in os.listdir(run.hf_dir)}
    assert set(modes.values()) == {0o666 & ~umask}, modes  # model.safetensors too, which safetensors writes 0600


def test_model_card_has_the_template_and_the_run(run):
    card = open(os.path.join(run.hf_dir, "README.md")).read()
    assert repr(run.cfg.prompt_template) in card
    assert "validation.csv" in card
    rows = run.ckpt["train_rows"]  # the data named by more than its file name: what the checkpoint records of it
    assert f"| train.csv: {len(rows['dialogues'])} training rows (CSV digest {rows['digest'][:16]}) |" in card
    assert f"| steps | {run.ckpt['iter_num']} " in card
    assert f"rougeL {run.ckpt['metrics']['rougeL']:.4f}" in card
    # exported without the training flags: what the card says of training comes from the checkpoint
    assert "base_model:" not in card and "| base model | scratch (init_from) |" in card
    assert "(batch 16 sequences" in card and "on up to 4 validation dialogues" in card


def test_a_flag_that_contradicts_the_run_in_the_card_is_one_line(run, tmp_path, capsys):
    ckpt = f"--ckpt={run.folder / 'out' / 'best.pt'}"
    err = one_line_error(capsys, export.main, [ckpt, f"--export_dir={tmp_path / 'hf'}", "--batch_size=64"])
    assert "--batch_size=64" in err and "batch_size=16" in err


def test_init_from_export_starts_at_the_checkpoints_loss(run, tmp_path):
    out = tmp_path / "more"
    train.main([*run.args, f"--init_from={run.hf_dir}", f"--out_dir={out}", "--max_iters=1", "--rouge_samples=0",
                "--best_metric=val_loss"])
    cfg = load_config([*run.args, f"--init_from={run.hf_dir}"])
    train_set = data.load_splits(cfg).train
    (x, y), = data.TrainBatches(train_set, cfg, 0, 1)(0).micro_batches
    with torch.no_grad():
        _, expected = run.model(x, y)
    assert metrics(out)[0]["loss"] == pytest.approx(expected.item(), rel=1e-6)


def one_line_error(capsys, main, argv):
    """The `error: ...` line that main(argv) exits with (code 2), after whatever progress it printed before."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        main(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "Traceback" not in err, err
    assert err.endswith("\n") and err.splitlines()[-1].startswith("error: "), err
    return err.splitlines()[-1]


def test_export_refuses_in_one_line(run, capsys, tmp_path):
    ckpt = f"--ckpt={run.folder / 'out' / 'best.pt'}"
    assert "missing.pt does not exist" in one_line_error(capsys, export.main, [f"--ckpt={tmp_path / 'missing.pt'}",
                                                                             f"--export_dir={tmp_path / 'x'}"])
    assert "--export_dir=DIR" in one_line_error(capsys, export.main, [ckpt])
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("keep me")
    assert "not empty" in one_line_error(capsys, export.main, [ckpt, f"--export_dir={busy}"])
    assert "will not delete it" in one_line_error(capsys, export.main, [ckpt, f"--export_dir={busy}",
                                                                        "--overwrite=True"])
    assert os.listdir(busy) == ["notes.txt"]
    assert "has no MBR decoding" in one_line_error(capsys, export.main, [ckpt, f"--export_dir={tmp_path / 'mbr'}",
                                                                         "--mbr_samples=4", "--temperature=0.7"])


def test_overwrite_replaces_an_export_atomically(run, capsys, monkeypatch, tmp_path):
    target = tmp_path / "hf"
    ckpt = f"--ckpt={run.folder / 'out' / 'best.pt'}"
    export.main([ckpt, f"--export_dir={target}"])
    before = {name: (target / name).read_bytes() for name in os.listdir(target)}

    def full_disk(*args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(export, "save_tokenizer", full_disk)
    err = one_line_error(capsys, export.main, [ckpt, f"--export_dir={target}", "--overwrite=True", "--num_beams=2"])
    assert "No space left on device" in err
    assert {name: (target / name).read_bytes() for name in os.listdir(target)} == before
    assert os.listdir(tmp_path) == ["hf"]  # no temporary folder left behind
    monkeypatch.undo()
    export.main([ckpt, f"--export_dir={target}", "--overwrite=True", "--num_beams=2"])
    assert GenerationConfig.from_pretrained(target).num_beams == 2
    assert os.listdir(tmp_path) == ["hf"]


def test_the_pipeline_recipe_cuts_dialogues_longer_than_the_positions_as_predict_does(run, capsys):
    """docs/export.md's pipeline recipe, with this export's path and the card's template line, summarizes dialogues
    of more tokens than the model has positions (a plain pipeline call fails on them) as the card's code and
    predict.py do."""
    recipe = open(os.path.join(REPO, "docs", "export.md"), encoding="utf-8").read()
    recipe = recipe.split("<!-- pipeline-recipe -->\n```python\n")[1].split("```")[0]
    card = open(os.path.join(run.hf_dir, "README.md"), encoding="utf-8").read()
    card_line = next(line for line in card.splitlines() if line.startswith("HEAD, TAIL, MAX_DIALOGUE_TOKENS = "))
    doc_line = next(line for line in recipe.splitlines() if line.startswith("HEAD, TAIL, MAX_DIALOGUE_TOKENS = "))
    long_dialogues = [" ".join(row["dialogue"] for row in synthetic_rows(8, seed=seed)) for seed in (5, 6)]
    tokenizer = GPT2TokenizerFast.from_pretrained(run.hf_dir)
    assert min(len(tokenizer.encode(d)) for d in long_dialogues) > run.model.config.block_size
    recipe = (recipe.replace('"out/export"', repr(run.hf_dir)).replace(doc_line, card_line)
              .replace("dialogues = [", f"dialogues = {long_dialogues!r} + ["))
    namespace = {}
    exec(recipe, namespace)
    assert namespace["summaries"][:2] == hf_summaries(run.hf_dir, long_dialogues)
    summary_model = inference.SummaryModel(run.model, run.cfg, trained_max_new_tokens=20)
    prompts, cut = summary_model.prompts(long_dialogues)
    ours = inference.summarize_batches(run.model, prompts, run.cfg, nullcontext())
    assert cut == 2 and namespace["summaries"][:2] == ours
