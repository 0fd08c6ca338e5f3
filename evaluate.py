"""ROUGE of a checkpoint on its run's validation split, or of several decoding settings side by side (--sweep).

    python evaluate.py [preset] [--ckpt=path | --baseline=scratch|gpt2|<hf dir>] [--key=value ...]
    python evaluate.py [preset] --sweep="num_beams=1,4 min_new_tokens=0,8"
    python evaluate.py [preset] --compare=<another out_dir or its eval_predictions.csv>
    torchrun --nproc_per_node=2 evaluate.py [...]          the validation set is sharded; rank 0 writes

Writes eval_predictions.csv, eval_metrics.json and eval_report.html into out_dir (a --baseline's into
out_dir/baseline-<name>/); --compare adds the paired ROUGE differences from another evaluation."""
import summarizer  # the standard library alone: first, before seconds of imports

summarizer.until_imported(__name__)
from summarizer.evaluation import evaluate, sweep
from summarizer.inference import decoding_command

summarizer.imported(__name__)


def main(argv=None):
    decoding_command(argv, __doc__, "evaluate.py", lambda cfg, *rest: (sweep if cfg.sweep else evaluate)(cfg, *rest))


if __name__ == "__main__":
    main()
