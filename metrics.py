"""ROUGE as the competition scores it (rouge-score F1, Porter stemmer on), and the minimum-Bayes-risk pick that
uses the same scorer to choose, among sampled summaries, the one that agrees most with the others."""
import functools

from rouge_score import rouge_scorer, tokenizers

from config import ROUGE_TYPES


def rouge_per_example(predictions, references):
    """rouge-score F1 (Porter stemmer on) for each (prediction, reference) pair: {type: [f1, ...]}."""
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    scores = {t: [] for t in ROUGE_TYPES}
    for prediction, reference in zip(predictions, references):
        result = scorer.score(reference, prediction)
        for t in ROUGE_TYPES:
            scores[t].append(result[t].fmeasure)
    return scores


def rouge(predictions, references):
    """Mean ROUGE F1 over the pairs: {type: mean}."""
    return {t: sum(v) / max(1, len(v)) for t, v in rouge_per_example(predictions, references).items()}


class MemoizedTokenizer(tokenizers.Tokenizer):
    """rouge-score's own tokenizer (stemmer on), run once per distinct text: MBR scores every candidate against
    every other, and stemming is most of what a score costs."""

    def __init__(self):
        self.tokens = functools.cache(tokenizers.DefaultTokenizer(use_stemmer=True).tokenize)

    def tokenize(self, text):
        return self.tokens(text)


def mbr_select(candidates, counts, metric="rougeL"):
    """Index of the candidate with the highest mean `metric` F1 against the other candidates, where candidate i
    stands for counts[i] identical samples (its copies count as others, scoring 1.0 when not empty). Ties go to
    the earlier candidate. F1 is symmetric, so each pair is scored once."""
    scorer = rouge_scorer.RougeScorer([metric], tokenizer=MemoizedTokenizer())
    n = len(candidates)
    agreement = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i, n):
            agreement[i][j] = agreement[j][i] = scorer.score(candidates[i], candidates[j])[metric].fmeasure
    total = sum(counts)
    utility = [(sum(c * a for c, a in zip(counts, agreement[i])) - agreement[i][i]) / max(1, total - 1)
               for i in range(n)]
    return max(range(n), key=lambda i: (utility[i], -i))
