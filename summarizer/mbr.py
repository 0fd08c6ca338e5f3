"""Minimum Bayes risk (MBR) decoding's choice: among a dialogue's candidate summaries, the one that agrees most,
by the competition's ROUGE, with the others. generate() draws the candidates and calls pick."""
from rapidfuzz import process
from rapidfuzz.distance import LCSseq
from rouge_score import rouge_scorer, scoring

import data
from summarizer.metrics import StemCachedTokenizer


def pick(candidates, metric="rougeL"):
    """generate's mbr_pick: the index of the best of the candidate token lists (mbr_select on their text)."""
    return mbr_select([data.summary_text(tokens) for tokens in candidates], metric)


def agreement(candidates, metric="rougeL"):
    """The matrix of `metric` F1 (rouge-score's) of every candidate (row) against every other as reference (column).
    rougeL's longest common subsequences come at once from rapidfuzz, in C++: rouge-score's were most of MBR's time."""
    tokenizer = StemCachedTokenizer()
    if metric == "rougeL":
        tokens = [tokenizer.tokenize(c) for c in candidates]
        lcs = process.cdist(tokens, tokens, scorer=LCSseq.similarity).tolist()
        return [[scoring.fmeasure(n / len(prediction), n / len(reference)) if prediction and reference else 0.0
                 for reference, n in zip(tokens, row, strict=True)]
                for prediction, row in zip(tokens, lcs, strict=True)]
    scorer = rouge_scorer.RougeScorer([metric], tokenizer=tokenizer)
    return [[scorer.score(reference, prediction)[metric].fmeasure for reference in candidates]
            for prediction in candidates]


def mbr_select(candidates, metric="rougeL"):
    """Index of the candidate with the highest mean `metric` F1 against the others (a copy of it among them scores
    1.0 when not empty); ties go to the earlier."""
    scores = agreement(candidates, metric)
    utility = [(sum(row) - row[i]) / max(1, len(candidates) - 1) for i, row in enumerate(scores)]
    return max(range(len(candidates)), key=lambda i: (utility[i], -i))
