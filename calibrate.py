"""The calibration stage (experimental, docs/calibration.md): continue a trained run with a ranking loss on
candidate summaries that the run's own weights write for every training dialogue. It is train.py's loop with a
ranking loss beside the token loss; every train.py setting and launcher applies.

    python calibrate.py [preset] --init_from=out/best.pt --out_dir=out-calibrated --rank_weight=1.0 [--key=value ...]
    torchrun --nproc_per_node=N --standalone calibrate.py [...]
    python calibrate.py --init_from=resume --out_dir=out-calibrated [--max_iters=N]     continue a calibration run

--init_from names the trained run's checkpoint (its best.pt): the new run takes that run's settings, its data,
template, learning rate and decoding included (a preset or a flag changes any but the model's shape), and writes
into --out_dir. Its own settings (the Calibration keys below):
--rank_weight (> 0, needed: the ranking loss's weight beside the token loss), --rank_candidates and
--rank_decoding (how many candidates per dialogue and how they are drawn), --rank_margin and
--rank_length_exponent (the loss's shape), --candidates_file (where the candidates are kept).
"""
from summarizer import quiet_start  # the standard library alone: first, before seconds of imports

quiet_start.until_imported(__name__)
import train
from summarizer.ranking import Ranking

quiet_start.imported(__name__)


def main(argv=None):
    """As train.main (argv None: the command line's, and max_time counts from the process's start)."""
    train.main(argv, objective=Ranking, script="calibrate.py", usage=__doc__)


if __name__ == "__main__":
    main()
