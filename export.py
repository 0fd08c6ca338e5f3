"""Export a checkpoint as a transformers GPT-2 folder (weights, config, tokenizer, decoding, model card).

    python export.py [preset] [--ckpt=path] --export_dir=DIR [--overwrite=True] [--num_beams=4 ...]

An explicit --key=value replaces a decoding setting of the run's, a preset does not. `--init_from=DIR` fine-tunes
the exported folder further."""
import summarizer  # the standard library alone: first, before seconds of imports

summarizer.until_imported(__name__)
import os
import shutil
import sys

import torch
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

import data
from command_line import UserError
from config import Config, Decoding, flags_given, load_config, part
from model import CONV1D_WEIGHTS, PRETRAINED
from summarizer.inference import describe_validation, open_summary_model, training_note
from summarizer.launch import one_line_errors

summarizer.imported(__name__)


def to_transformers(model):
    """The same tensors, Conv1D weights transposed (GPT.from_pretrained's mirror), and zero biases for bias=False."""
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


def generation_config(d):
    if d.mbr_samples > 0:
        raise UserError(f"mbr_samples={d.mbr_samples}: transformers' generate() has no MBR decoding to put in "
                        f"generation_config.json; export with --mbr_samples=0 and the greedy, beam or sampling "
                        f"settings to ship")
    settings = dict(max_new_tokens=d.max_new_tokens, num_beams=d.num_beams, repetition_penalty=d.repetition_penalty,
                    no_repeat_ngram_size=d.no_repeat_ngram_size, do_sample=d.temperature > 0,
                    bos_token_id=data.EOT_ID, eos_token_id=data.EOT_ID, pad_token_id=data.EOT_ID)
    if d.num_beams > 1:
        settings.update(length_penalty=d.length_penalty, early_stopping=False)
    if d.min_new_tokens > 0:
        settings["min_new_tokens"] = d.min_new_tokens
    if d.temperature > 0:  # top_k=0 is off in both, whereas transformers' own default is 50
        settings.update(temperature=d.temperature, top_k=d.top_k, top_p=d.top_p)
        if d.epsilon > 0:
            settings["epsilon_cutoff"] = d.epsilon
    return GenerationConfig(**settings)


def save_tokenizer(folder, block_size):
    """GPT-2's BPE files and the transformers tokenizer: <|endoftext|> is end and left padding, in a text just text."""
    for source, name in zip(data.bpe_files(), ("vocab.json", "merges.txt"), strict=True):
        shutil.copy(source, os.path.join(folder, name))
    GPT2TokenizerFast.from_pretrained(folder, model_max_length=block_size, pad_token=data.EOT_TOKEN,
                                      padding_side="left", split_special_tokens=True).save_pretrained(folder)


def model_card(ckpt, trained, cfg, fmt, name):
    metrics, rows = ckpt["metrics"], ckpt["train_rows"]
    training = (f"{os.path.basename(trained.train_csv)}: {len(rows['dialogues'])} training rows (CSV digest "
                f"{rows['digest'][:16]})")
    scores = ", ".join(f"{k} {metrics[k]:.4f}" for k in ("val_loss", "rouge1", "rouge2", "rougeL") if k in metrics)
    if "rougeL" in metrics:
        scores += f" (ROUGE F1 on up to {trained.rouge_samples} validation dialogues)"
    validation = describe_validation(trained).removeprefix("validation ")
    base = (trained.init_from if trained.init_from in PRETRAINED else
            "not recorded (a resumed run's checkpoint written before 2026-11-26)" if trained.init_from == "resume"
            else f"{trained.init_from} (init_from)")
    decoding = "beam search" if cfg.num_beams > 1 else "sampling" if cfg.temperature > 0 else "greedy"
    block_size = ckpt["model_args"]["block_size"]
    front = "\n".join(["---", "library_name: transformers", "pipeline_tag: text-generation",
                       *([f"base_model: {trained.init_from}"] if trained.init_from in PRETRAINED else []),
                       "tags:", "- summarization", "- dialogue", "- gpt2", "---"])
    return f"""{front}

# {name}

GPT-2 fine-tuned to summarize dialogues (SAMSum format: `id,dialogue,summary`).

| | |
| --- | --- |
| base model | {base} |
| training data | {training} |
| validation data | {validation} |
| steps | {ckpt["iter_num"]} (batch {trained.batch_size} sequences of up to {block_size} tokens) |
| validation scores at that step | {scores or "none recorded"} |
| decoding | generation_config.json: {decoding}, up to {cfg.max_new_tokens} new tokens |

## Prompt

The model only summarizes dialogues wrapped in the template it was trained with, `{cfg.prompt_template!r}`,
with `\\n` line breaks. The text before and after `{{dialogue}}` and the dialogue are tokenized each on its own.
The model has {block_size} positions and generates up to {cfg.max_new_tokens} tokens, so a prompt keeps the
**first {fmt.max_dialogue} tokens** of a dialogue and cuts the end of a longer one, as in training and
evaluation (a longer prompt would not fit: transformers raises an IndexError). The summary ends with
`<|endoftext|>`. `prompt_ids` below builds a prompt exactly so.

{usage(name, *data.template_text(cfg.prompt_template), fmt.max_dialogue)}"""


def usage(name, head, tail, max_dialogue):
    return f"""## Use

```python
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

path = "{name}"  # this folder, or its id on the Hugging Face Hub
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path)
HEAD, TAIL, MAX_DIALOGUE_TOKENS = {head!r}, {tail!r}, {max_dialogue}


def prompt_ids(dialogue):
    dialogue = dialogue.replace("\\r\\n", "\\n").replace("\\r", "\\n").strip()
    ids = tokenizer.encode(HEAD) + tokenizer.encode(dialogue)[:MAX_DIALOGUE_TOKENS] + tokenizer.encode(TAIL)
    return ids or [tokenizer.eos_token_id]


def summarize(dialogue):
    ids = torch.tensor([prompt_ids(dialogue)])
    output = model.generate(ids, attention_mask=torch.ones_like(ids))  # settings: generation_config.json
    return tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True).strip()


print(summarize("Amanda: I baked cookies. Do you want some?\\nJerry: Sure!\\nAmanda: I'll bring you tomorrow :-)"))
```
"""


def check_target(path, overwrite):
    """Absent, empty, or (with overwrite) an earlier export: overwrite never deletes another folder."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"export_dir {path} is a file: choose a folder with --export_dir=DIR")
    if not os.path.exists(path) or not os.listdir(path):
        return
    if not overwrite:
        raise UserError(f"export_dir {path} is not empty: choose a new folder, or pass --overwrite=True to "
                        f"replace the export in it")
    if not all(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "model.safetensors")):
        raise UserError(f"export_dir {path} is not empty and holds no earlier export (config.json, "
                        f"model.safetensors), so --overwrite=True will not delete it: choose another folder")


def replace_folder(tmp, target):
    """An earlier target is moved aside, and deleted only once tmp is in its place."""
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


def export(cfg, explicit=()):
    if not cfg.export_dir:
        raise UserError("pass --export_dir=DIR: the folder to write the transformers model to")
    if cfg.baseline:
        raise UserError("export.py exports a checkpoint (--ckpt), not a --baseline")
    target = os.path.abspath(cfg.export_dir)
    check_target(target, cfg.overwrite)
    # what the card says of training is the run's: flags only repeat it
    summary_model = open_summary_model(cfg, explicit, "export")
    trained = Config(**summary_model.ckpt["config"])
    hf = to_transformers(summary_model.model)
    hf.generation_config = generation_config(part(summary_model.cfg, Decoding))
    tmp = f"{target}.tmp{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        hf.save_pretrained(tmp)
        save_tokenizer(tmp, summary_model.model.config.block_size)
        with open(os.path.join(tmp, "README.md"), "w", encoding="utf-8") as f:
            f.write(model_card(summary_model.ckpt, trained, summary_model.cfg, summary_model.prompt_format(),
                               os.path.basename(target)))
        for name in os.listdir(tmp):  # safetensors writes 0600, unreadable to the others: a new file's mode
            shutil.copymode(os.path.join(tmp, "README.md"), os.path.join(tmp, name))
        replace_folder(tmp, target)
    except OSError as e:
        raise UserError(f"cannot write export_dir {target} ({e.strerror or e}); it was left as it was") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if note := training_note(summary_model.path):
        print(note)
    print(f"exported {summary_model.weights} to {target}: {', '.join(sorted(os.listdir(target)))}")
    return target


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    with one_line_errors():
        export(load_config(argv, __doc__, "export.py"), flags_given(argv))


if __name__ == "__main__":
    main()
