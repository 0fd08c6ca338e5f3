"""The calibration stage (experimental, docs/calibration.md): continue a trained run with a ranking loss on
candidate summaries that the run's own weights write for every training dialogue. It is train.py's loop with the
Ranking objective of summarizer/ranking.py; every train.py setting and launcher applies.

    python calibrate.py [preset] --init_from=out/best.pt --out_dir=out-calibrated --rank_weight=1.0 [--key=value ...]
    torchrun --nproc_per_node=N --standalone calibrate.py [...]
"""
import sys

import train
from config import load_config
from summarizer.errors import UserError
from summarizer.launch import one_line_errors
from summarizer.ranking import Ranking


def main(argv=None):
    """As train.main (argv None: the command line's, and max_time counts from the process's start)."""
    with one_line_errors():
        if load_config(sys.argv[1:] if argv is None else argv).rank_weight <= 0:
            raise UserError("calibrate.py needs --rank_weight > 0: the weight of the ranking loss beside the token "
                            "loss (1.0 is a start; docs/calibration.md)")
    train.main(argv, objective=Ranking, script="calibrate.py")


if __name__ == "__main__":
    main()
