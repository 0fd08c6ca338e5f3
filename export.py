"""Export a checkpoint as a transformers GPT-2 folder (weights, config, tokenizer, decoding settings, model card)
for from_pretrained, pipeline, the Hugging Face Hub or a Kaggle dataset.

    python export.py [preset] [--ckpt=path] --export_dir=DIR [--overwrite=True] [--num_beams=4 ...]

The decoding settings (generation_config.json) and the prompt template are the run's, read from the
checkpoint; keys given here, in a preset or as --key=value, replace them. `--init_from=DIR` fine-tunes the
exported folder further.
"""
import os
import shutil
import sys
from dataclasses import asdict

import torch
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

import data
from checkpoint import load_checkpoint, model_from_checkpoint
from config import FIELDS, GPT2_NAMES, Config, UserError, load_config
from model import CONV1D_WEIGHTS


def to_transformers(model):
    """A GPT2LMHeadModel that computes what our GPT computes: the same tensors with the Conv1D weights transposed
    (the mirror of GPT.from_pretrained), and zero biases for a model trained with bias=False."""
    c = model.config
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd,
                                    n_layer=c.n_layer, n_head=c.n_head, resid_pdrop=c.dropout,
                                    embd_pdrop=c.dropout, attn_pdrop=c.dropout, pad_token_id=data.EOT_ID))
    ours = model.state_dict()
    state = {}
    for name, p in hf.state_dict().items():
        if name in ours:
            state[name] = ours[name].t() if name.endswith(CONV1D_WEIGHTS) else ours[name]
        elif not c.bias and name.endswith(".bias"):
            state[name] = torch.zeros_like(p)
    hf.load_state_dict(state)  # strict: a weight of ours without a place in GPT-2 is an error, not dropped
    return hf.eval()


def generation_config(run):
    """transformers' GenerationConfig for the decoding that summarize() does with the run's settings (`run`: the
    config as a dict; keys a checkpoint from an older version lacks fall back to the old defaults)."""
    settings = dict(max_new_tokens=run.get("max_new_tokens", 128), num_beams=run.get("num_beams", 1),
                    repetition_penalty=run.get("repetition_penalty", 1.0),
                    no_repeat_ngram_size=run.get("no_repeat_ngram_size", 0),
                    bos_token_id=data.EOT_ID, eos_token_id=data.EOT_ID, pad_token_id=data.EOT_ID)
    if settings["num_beams"] > 1:
        settings.update(length_penalty=run.get("length_penalty", 1.0), early_stopping=False)
    if run.get("min_new_tokens", 0) > 0:
        settings["min_new_tokens"] = run["min_new_tokens"]
    if run.get("temperature", 0.0) > 0:  # top_k=0 is off in both, whereas transformers' own default is 50
        settings.update(do_sample=True, temperature=run["temperature"], top_k=run.get("top_k", 0),
                        top_p=run.get("top_p", 1.0))
    else:
        settings["do_sample"] = False
    return GenerationConfig(**settings)


def save_tokenizer(folder, block_size):
    """GPT-2's vocab.json and merges.txt (the files our tokenizer is built from) plus the transformers tokenizer
    files: <|endoftext|> is end, padding (on the left, for batched generation) and, written in a text, just text."""
    encoder_json, vocab_bpe = data.bpe_files()
    shutil.copy(encoder_json, os.path.join(folder, "vocab.json"))
    shutil.copy(vocab_bpe, os.path.join(folder, "merges.txt"))
    tokenizer = GPT2TokenizerFast.from_pretrained(folder, model_max_length=block_size, pad_token=data.EOT_TOKEN,
                                                  padding_side="left", split_special_tokens=True)
    tokenizer.save_pretrained(folder)


def model_card(ckpt, run, name):
    """README.md of the folder: what the model is, how it was trained and scored, and how to prompt it."""
    metrics = ckpt.get("metrics", {})
    scores = ", ".join(f"{k} {metrics[k]:.4f}" for k in ("val_loss", "rouge1", "rouge2", "rougeL") if k in metrics)
    if "rougeL" in metrics:
        scores += f" (ROUGE F1 on up to {run.rouge_samples} validation dialogues)"
    validation = (os.path.basename(run.validation_csv) if run.validation_csv
                  else f"{run.val_fraction:.0%} of {os.path.basename(run.train_csv)} held out")
    base = run.init_from if run.init_from in GPT2_NAMES else f"{run.init_from} (init_from)"
    decoding = "beam search" if run.num_beams > 1 else "sampling" if run.temperature > 0 else "greedy"
    head, tail = data.template_tokens(run.prompt_template)
    block_size = ckpt["model_args"]["block_size"]
    max_dialogue = block_size - run.max_new_tokens - len(head) - len(tail)
    front = "\n".join(["---", "library_name: transformers", "pipeline_tag: text-generation",
                       *([f"base_model: {run.init_from}"] if run.init_from in GPT2_NAMES else []),
                       "tags:", "- summarization", "- dialogue", "- gpt2", "---"])
    return f"""{front}

# {name}

GPT-2 fine-tuned to summarize dialogues (SAMSum format: `id,dialogue,summary`).

| | |
| --- | --- |
| base model | {base} |
| training data | {os.path.basename(run.train_csv)} |
| validation data | {validation} |
| steps | {ckpt.get("iter_num", "?")} (batch {run.batch_size} sequences of up to {block_size} tokens) |
| validation scores at that step | {scores or "none recorded"} |
| decoding | generation_config.json: {decoding}, up to {run.max_new_tokens} new tokens |

## Prompt

The model only summarizes dialogues wrapped in the template it was trained with:

```python
TEMPLATE = {run.prompt_template!r}
prompt = TEMPLATE.format(dialogue=dialogue.strip())
```

Use `\\n` line breaks in the dialogue. A dialogue longer than {max_dialogue} tokens was cut to its first
{max_dialogue} tokens in training and evaluation; cut yours the same way. The summary ends with `<|endoftext|>`.

## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

path = "{name}"  # this folder, or its id on the Hugging Face Hub
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path)
TEMPLATE = {run.prompt_template!r}
dialogue = "Amanda: I baked cookies. Do you want some?\\nJerry: Sure!\\nAmanda: I'll bring you tomorrow :-)"
inputs = tokenizer(TEMPLATE.format(dialogue=dialogue.strip()), return_tensors="pt")
output = model.generate(**inputs)  # decoding settings come from generation_config.json
print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip())
```
"""


def run_config(ckpt, argv):
    """The config the checkpoint was trained with, updated by the presets and --key=value arguments given now."""
    saved = {key: value for key, value in ckpt.get("config", {}).items() if key in FIELDS}
    return load_config(argv, base=Config(**saved))


def check_target(path, overwrite):
    """UserError unless `path` can take the export: absent, empty, or (with overwrite) an earlier export."""
    if not os.path.exists(path):
        return
    if not os.path.isdir(path):
        raise UserError(f"export_dir {path} is a file: choose a folder with --export_dir=DIR")
    if not os.listdir(path):
        return
    if not overwrite:
        raise UserError(f"export_dir {path} is not empty: choose a new folder, or pass --overwrite=True to "
                        f"replace the export in it")
    if not all(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "model.safetensors")):
        raise UserError(f"export_dir {path} is not empty and holds no earlier export (config.json, "
                        f"model.safetensors), so --overwrite=True will not delete it: choose another folder")


def replace_folder(tmp, target):
    """Rename folder tmp to target. An earlier target is moved aside first, and deleted only once tmp is in place."""
    old = f"{target}.old{os.getpid()}"
    if os.path.exists(target):
        os.rename(target, old)
    try:
        os.rename(tmp, target)
    except OSError:
        if os.path.exists(old):
            os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def export(cfg, argv):
    """Write the folder next to export_dir under a temporary name, then rename it into place. Returns its path."""
    if not cfg.export_dir:
        raise UserError("pass --export_dir=DIR: the folder to write the transformers model to")
    target = os.path.abspath(cfg.export_dir)
    check_target(target, cfg.overwrite)
    source = cfg.ckpt or os.path.join(cfg.out_dir, "best.pt")
    ckpt = load_checkpoint(source)
    model = model_from_checkpoint(ckpt, source)
    run = run_config(ckpt, argv)
    tmp = f"{target}.tmp{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        hf = to_transformers(model)
        hf.generation_config = generation_config(asdict(run))
        hf.save_pretrained(tmp)
        save_tokenizer(tmp, model.config.block_size)
        with open(os.path.join(tmp, "README.md"), "w", encoding="utf-8") as f:
            f.write(model_card(ckpt, run, os.path.basename(target)))
        replace_folder(tmp, target)
    except OSError as e:
        raise UserError(f"cannot write export_dir {target} ({e.strerror or e}); it was left as it was") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"exported {source} (step {ckpt.get('iter_num', '?')}) to {target}: "
          f"{', '.join(sorted(os.listdir(target)))}")
    return target


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        export(load_config(argv), argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
