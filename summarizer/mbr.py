"""Minimum Bayes risk decoding's choice: the candidate summary that agrees most, by ROUGE, with the others."""
from rapidfuzz import process
from rapidfuzz.distance import LCSseq
from rouge_score import rouge_scorer, scoring

import data
from summarizer.metrics import StemCachedTokenizer


def pick(candidates, metric="rougeL"):
    """generate's mbr_pick, on token lists."""
    return mbr_select([data.summary_text(tokens) for tokens in candidates], metric)


def agreement(candidates, metric="rougeL"):
    """`metric` F1 of every candidate (row) against every other (column). rougeL's LCS comes from rapidfuzz
    (C++): rouge-score's was most of MBR's time."""
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
    """Index of the highest mean F1 against the others; ties go to the earlier."""
    scores = agreement(candidates, metric)
    utility = [(sum(row) - row[i]) / max(1, len(candidates) - 1) for i, row in enumerate(scores)]
    return max(range(len(candidates)), key=lambda i: (utility[i], -i))
