"""The checkpoint is the contract: evaluate.py, predict.py and export.py prompt, cut, split and decode as the run
did, whatever preset they are given; flags that contradict it stop in one line; rows the run trained on are never
scored."""
import json

import pandas as pd
import pytest
import torch
from transformers import GenerationConfig

import evaluate
import export
import predict
import train
from config import load_config
from conftest import card_code, one_error_line, save_csv, synthetic_rows, tiny
from summarizer import inference
from summarizer.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow  # every test uses a model trained 40 steps

TEMPLATE = "Chat log:\n{dialogue}\nIn one sentence:"
RUN = [*tiny(n_embd=64, max_new_tokens=None), "--batch_size=16", "--micro_batch_size=16", "--learning_rate=1e-2",
       "--warmup_iters=5", "--log_interval=1000", "--gen_batch_size=8", "--sample_submission_csv="]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained with a custom template, its own validation CSV and max_new_tokens=12; `preset` is
    what a user passes later: the data and out_dir of the preset, none of the run's training flags."""
    folder = tmp_path_factory.mktemp("contract")
    save_csv(folder / "train.csv", synthetic_rows(64, seed=0))
    train_dialogues = set(pd.read_csv(folder / "train.csv")["dialogue"])
    val = pd.DataFrame(synthetic_rows(40, seed=3))
    val = val[~val["dialogue"].isin(train_dialogues)].head(12)
    save_csv(folder / "validation.csv", val)
    other = pd.DataFrame(synthetic_rows(60, seed=11))
    other = other[~other["dialogue"].isin(train_dialogues | set(val["dialogue"]))].head(10)
    other["id"] = [f"other-{i}" for i in range(len(other))]
    save_csv(folder / "other.csv", other)
    save_csv(folder / "test.csv", other, test=True)
    preset = [*RUN, f"--train_csv={folder / 'train.csv'}", f"--test_csv={folder / 'test.csv'}",
              f"--data_cache_dir={folder / 'cache'}", f"--out_dir={folder / 'out'}"]
    training = [*preset, f"--prompt_template={TEMPLATE!r}", f"--validation_csv={folder / 'validation.csv'}",
                "--max_new_tokens=12", "--max_iters=40", "--eval_interval=40", "--rouge_samples=12"]
    train.main(training)
    best = f"--ckpt={folder / 'out' / 'best.pt'}"  # as the preset's out_dir says: outputs go elsewhere below
    return folder, [*preset, best], [*training, best]


def test_the_preset_alone_scores_and_predicts_as_the_training_flags_do(trained, tmp_path, capsys):
    folder, preset, training = trained
    outputs = {}
    for name, argv in (("preset", preset), ("training", training)):
        out = tmp_path / name
        evaluate.main([*argv, f"--out_dir={out}"])
        predict.main([*argv, f"--out_dir={out}"])
        first_line = capsys.readouterr().out.splitlines()[0]
        outputs[name] = (json.loads((out / "eval_metrics.json").read_text()), (out / "submission.csv").read_bytes())
        assert f"template {TEMPLATE!r}" in first_line and f"validation {folder / 'validation.csv'}" in first_line
        assert "decoding: greedy: max_new_tokens=12 (the run's)" in first_line
    assert outputs["preset"] == outputs["training"]
    report = outputs["preset"][0]
    assert report["n"] == 12 and report["rougeL"]["mean"] > 0.2  # the run's template: it learned to summarize
    # the training-time ROUGE (same dialogues, template and decoding) is what evaluate.py reports
    best = load_checkpoint(str(folder / "out" / "best.pt"))
    assert report["rougeL"]["mean"] == pytest.approx(best["metrics"]["rougeL"], abs=1e-12)


def test_a_flag_that_contradicts_the_checkpoint_is_one_line(trained, tmp_path, capsys):
    folder, preset, _ = trained
    for main in (evaluate.main, predict.main):
        err = one_error_line(capsys, main, [*preset, "--prompt_template='{dialogue} TL;DR:'",
                                            f"--out_dir={tmp_path / 'x'}"])
        assert "--prompt_template='{dialogue} TL;DR:'" in err
        assert f"prompt_template={TEMPLATE!r}" in err
    err = one_error_line(capsys, evaluate.main, [*preset, "--block_size=64", f"--out_dir={tmp_path / 'x'}"])
    assert "--block_size=64" in err and "block_size=128" in err
    assert not (tmp_path / "x").exists()  # a failed command leaves no empty out_dir behind


def test_a_decoding_flag_overrides_the_runs_and_the_first_line_says_so(trained, tmp_path, capsys):
    folder, preset, _ = trained
    predict.main([*preset, "--num_beams=3", f"--out_dir={tmp_path}"])
    first_line = capsys.readouterr().out.splitlines()[0]
    assert first_line.startswith(f"weights: {folder / 'out' / 'best.pt'} (iter 40, best rougeL ")
    assert "decoding: beam search: max_new_tokens=12 num_beams=3 (the run's, except --num_beams)" in first_line


@pytest.mark.parametrize("flags, said", [
    (["--top_k=50", "--length_penalty=0.8"], "greedy: max_new_tokens=128 (this command's); top_k=50 length_penalty=0.8 "
                                             "ignored by greedy"),
    (["--num_beams=4", "--top_p=0.9", "--seed=3"], "beam search: max_new_tokens=128 num_beams=4 (this command's); "
                                                   "top_p=0.9 ignored by beam search"),
    (["--temperature=0.7", "--top_k=50", "--length_penalty=0.8", "--mbr_metric=rouge1"],
     "sampling: max_new_tokens=128 temperature=0.7 top_k=50 (this command's); length_penalty=0.8 mbr_metric=rouge1 "
     "ignored by sampling"),
    (["--temperature=0.7", "--mbr_samples=8", "--num_beams=2", "--length_penalty=0.8", "--seed=3"],
     "MBR: max_new_tokens=128 num_beams=2 temperature=0.7 length_penalty=0.8 mbr_samples=8 seed=3 (this command's)")])
def test_the_decoding_line_shows_what_acts_on_its_kind_and_says_what_it_ignores(flags, said):
    """A greedy seed is training's, not an ignored decoding setting; MBR's beam candidate takes length_penalty."""
    assert inference.describe_decoding(load_config(flags), from_run=False) == said


def test_rows_the_run_trained_on_are_refused_and_a_disjoint_csv_is_scored(trained, tmp_path, capsys):
    folder, preset, _ = trained
    for flags in ([f"--validation_csv={folder / 'train.csv'}"], ["--validation_csv=", "--val_fraction=0.2"]):
        err = one_error_line(capsys, evaluate.main, [*preset, *flags, f"--out_dir={tmp_path / 'x'}"])
        assert "validation rows" in err and "trained on" in err and "--validation_csv" in err
    # the same dialogues under new ids are still rows it trained on
    copy = pd.read_csv(folder / "train.csv").head(5).assign(id=lambda f: "new-" + f["id"])
    copy.to_csv(tmp_path / "renamed.csv", index=False)
    err = one_error_line(capsys, evaluate.main, [*preset, f"--validation_csv={tmp_path / 'renamed.csv'}",
                                                 f"--out_dir={tmp_path / 'x'}"])
    assert "5 of the 5 validation rows" in err
    evaluate.main([*preset, f"--validation_csv={folder / 'other.csv'}", f"--out_dir={tmp_path / 'other'}"])
    assert f"validation {folder / 'other.csv'}" in capsys.readouterr().out.splitlines()[0]
    scored = pd.read_csv(tmp_path / "other" / "eval_predictions.csv")
    assert scored["id"].tolist() == pd.read_csv(folder / "other.csv")["id"].tolist()


def test_export_with_a_preset_keeps_the_runs_settings_and_cuts_like_training(trained, tmp_path):
    folder, _, _ = trained
    preset = tmp_path / "preset.json"
    preset.write_text(json.dumps({"max_new_tokens": 32, "validation_csv": "elsewhere.csv",
                                  "out_dir": str(folder / "out")}))
    export.main([str(preset), f"--export_dir={tmp_path / 'hf'}"])
    assert GenerationConfig.from_pretrained(tmp_path / "hf").max_new_tokens == 12
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "validation.csv" in card and "elsewhere.csv" not in card
    head, tail = len(data_tokens(TEMPLATE)[0]), len(data_tokens(TEMPLATE)[1])
    assert f"**first {128 - 12 - head - tail} tokens**" in card
    export.main([str(preset), "--max_new_tokens=20", f"--export_dir={tmp_path / 'hf20'}"])
    assert GenerationConfig.from_pretrained(tmp_path / "hf20").max_new_tokens == 20


def test_a_long_dialogue_is_cut_alike_by_predict_and_by_the_exported_models_card(trained, tmp_path, capsys):
    folder, preset, _ = trained
    long = "\n".join(pd.read_csv(folder / "other.csv")["dialogue"])  # far over the 128 positions
    dialogues = [long, "Ann: are you coming?\nBob: yes, at 8"]
    pd.DataFrame({"id": ["long", "short"], "dialogue": dialogues}).to_csv(tmp_path / "test.csv", index=False)
    predict.main([*preset, f"--test_csv={tmp_path / 'test.csv'}", f"--out_dir={tmp_path / 'p'}"])
    assert "cut the end of 1 of 2 dialogue(s)" in capsys.readouterr().out
    ours = pd.read_csv(tmp_path / "p" / "submission.csv", dtype=str, keep_default_na=False)["summary"].tolist()
    export.main([*preset, f"--export_dir={tmp_path / 'hf'}"])
    card = card_code(str(tmp_path / "hf"))
    prompts, cut = inference.open_summary_model(load_config(preset)).prompts(dialogues)
    assert cut == 1 and [card["prompt_ids"](d) for d in dialogues] == prompts and len(prompts[0]) == 128 - 12
    with torch.no_grad():  # no IndexError: the exported model gets a prompt that leaves room for the summary
        assert [card["summarize"](d) for d in dialogues] == ours


def data_tokens(template):
    import data
    return data.template_tokens(template)
