"""The token and span kinds' metrics against their references' own published outputs. No Ray.

Entities: seqeval 1.2.2's README and test files (tests/test_metrics.py, tests/test_scheme.py), and the CoNLL
shared tasks' `conlleval` script run on the first three sentences of seqeval's tests/data/ground_truth.txt
(CoNLL-2000 chunking, gold and predicted tags). SQuAD: the official v1.1 and v2.0 evaluation scripts' rules,
on a real SQuAD v1.1 question (allennlp 0.9.0's tests/fixtures/data/squad.json) and the outputs the `evaluate`
library's squad and squad_v2 metric cards publish for their examples.
"""

from __future__ import annotations

import numpy as np
import pytest

from stages.finetune.kinds import span, squad_eval
from stages.finetune.kinds.entities import entity_scores, get_entities, infer_scheme

# ----------------------------------------------------------------------------------------------- seqeval


def test_readme_example_default_and_strict():
    """seqeval README: f1_score 0.50; MISC 0/0/0, PER 1/1/1 in both modes under IOB2."""
    y_true = [["O", "O", "O", "B-MISC", "I-MISC", "I-MISC", "O"], ["B-PER", "I-PER", "O"]]
    y_pred = [["O", "O", "B-MISC", "I-MISC", "I-MISC", "I-MISC", "O"], ["B-PER", "I-PER", "O"]]
    for mode in ("default", "strict"):
        s = entity_scores(y_true, y_pred, "IOB2", mode)
        assert (s["precision"], s["recall"], s["f1"], s["support"]) == (0.5, 0.5, 0.5, 2)
        assert s["per_type"]["MISC"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 1}
        assert s["per_type"]["PER"] == {"precision": 1.0, "recall": 1.0, "f1": 1.0, "support": 1}


def test_readme_lenient_versus_strict():
    """seqeval README and test_conll_f1score / test_strict_f1score: I-NP I-NP for B-NP I-NP is 1.0 by
    conlleval's reading and 0.0 under strict IOB2."""
    for gold, pred, tag in ((["B-NP", "I-NP", "O"], ["I-NP", "I-NP", "O"], "NP"),
                            (["B-ORG", "I-ORG"], ["I-ORG", "I-ORG"], "ORG")):
        assert entity_scores([gold], [pred], "IOB2")["f1"] == 1.0
        strict = entity_scores([gold], [pred], "IOB2", "strict")
        assert strict["f1"] == 0.0 and strict["per_type"][tag]["support"] == 1


def test_get_entities_default_mode():
    """seqeval tests/test_metrics.py and the get_entities docstring (their end inclusive, ours exclusive)."""
    tags = ["O", "O", "O", "B-MISC", "I-MISC", "I-MISC", "O", "B-PER", "I-PER"]
    assert get_entities(tags) == [("MISC", 3, 6), ("PER", 7, 9)]
    assert get_entities(["B-PER", "I-PER", "O", "B-LOC"]) == [("PER", 0, 2), ("LOC", 3, 4)]
    assert get_entities(["O", "O", "O", "B", "I", "I", "O"]) == [("_", 3, 6)]  # bare IOB: type "_"
    # conlleval's reading of IOB1 (CoNLL-2003's first sentence) and of BIOES
    assert get_entities(["I-ORG", "O", "I-PER", "O", "O", "I-LOC", "O"]) == [("ORG", 0, 1), ("PER", 2, 3),
                                                                           ("LOC", 5, 6)]
    assert get_entities(["B-PER", "E-PER", "S-LOC", "I-PER", "I-PER"]) == [("PER", 0, 2), ("LOC", 2, 3),
                                                                           ("PER", 3, 5)]
    # E- and S- close an entity even before one of the same type (seqeval 1.2.2's output, ends made exclusive)
    assert get_entities(["S-PER", "S-PER", "B-PER", "E-PER", "E-PER"]) == [("PER", 0, 1), ("PER", 1, 2),
                                                                           ("PER", 2, 4), ("PER", 4, 5)]
    assert get_entities(["B-LOC", "E-LOC", "I-LOC", "O", "S-LOC"]) == [("LOC", 0, 2), ("LOC", 2, 3), ("LOC", 4, 5)]


# seqeval tests/test_scheme.py: test_iob1_tokens, test_iob2_tokens, test_iobes_tokens (entity ends exclusive)
STRICT_CASES = {
    "IOB1": [
        (["B-PER"], []), (["I-PER"], [("PER", 0, 1)]), (["O", "I-PER"], [("PER", 1, 2)]), (["O", "B-PER"], []),
        (["I-PER", "I-PER"], [("PER", 0, 2)]), (["I-PER", "I-ORG"], [("PER", 0, 1), ("ORG", 1, 2)]),
        (["I-PER", "B-PER"], [("PER", 0, 1), ("PER", 1, 2)]), (["I-PER", "B-ORG"], [("PER", 0, 1)]),
        (["B-PER", "I-PER"], [("PER", 1, 2)]), (["B-PER", "I-ORG"], [("ORG", 1, 2)]),
        (["B-PER", "B-PER"], [("PER", 1, 2)]), (["B-PER", "B-ORG"], []),
    ],
    "IOB2": [
        (["B-PER"], [("PER", 0, 1)]), (["I-PER"], []), (["O", "I-PER"], []), (["O", "B-PER"], [("PER", 1, 2)]),
        (["I-PER", "B-ORG"], [("ORG", 1, 2)]), (["B-PER", "I-PER"], [("PER", 0, 2)]),
        (["B-PER", "I-ORG"], [("PER", 0, 1)]), (["B-PER", "B-PER"], [("PER", 0, 1), ("PER", 1, 2)]),
        (["B-PER", "B-ORG"], [("PER", 0, 1), ("ORG", 1, 2)]),
    ],
    "BIOES": [
        (["B-PER"], []), (["E-PER"], []), (["S-PER"], [("PER", 0, 1)]), (["O", "S-PER"], [("PER", 1, 2)]),
        (["I-PER", "E-PER"], []), (["I-PER", "S-PER"], [("PER", 1, 2)]), (["B-PER", "I-PER"], []),
        (["B-PER", "E-PER"], [("PER", 0, 2)]), (["B-PER", "E-ORG"], []), (["B-PER", "S-PER"], [("PER", 1, 2)]),
        (["S-PER", "E-PER"], [("PER", 0, 1)]), (["S-PER", "S-PER"], [("PER", 0, 1), ("PER", 1, 2)]),
    ],
}


@pytest.mark.parametrize("scheme,tags,expected", [(s, t, e) for s, cases in STRICT_CASES.items() for t, e in cases])
def test_strict_entities_follow_seqeval_scheme_tables(scheme, tags, expected):
    assert get_entities(tags, scheme, "strict") == expected


def test_strict_rejects_a_prefix_outside_the_scheme():
    with pytest.raises(ValueError, match="not allowed in IOB2"):
        get_entities(["B-PER", "E-PER"], "IOB2", "strict")
    with pytest.raises(ValueError, match="needs a scheme"):
        get_entities(["B-PER"], None, "strict")


# The first three sentences of seqeval's tests/data/ground_truth.txt: word, gold chunk, predicted chunk.
CONLL2000 = """Rockwell B-NP I-NP|International I-NP I-NP|Corp. I-NP I-NP|'s B-NP B-NP|Tulsa I-NP I-NP|unit I-NP I-NP
said B-VP B-VP|it B-NP B-NP|signed B-VP B-VP|a B-NP B-NP|tentative I-NP I-NP|agreement I-NP I-NP
extending B-VP B-VP|its B-NP B-NP|contract I-NP I-NP|with B-PP B-PP|Boeing B-NP I-NP|Co. I-NP I-NP|to B-VP B-PP
provide I-VP I-VP|structural B-NP I-NP|parts I-NP I-NP|for B-PP B-PP|Boeing B-NP I-NP|'s B-NP B-NP|747 I-NP I-NP
jetliners I-NP I-NP|. O O
#
Rockwell B-NP I-NP|said B-VP B-VP|the B-NP B-NP|agreement I-NP I-NP|calls B-VP B-VP|for B-SBAR B-PP|it B-NP B-NP
to B-VP B-PP|supply I-VP I-VP|200 B-NP I-NP|additional I-NP B-NP|so-called I-NP I-NP|shipsets I-NP I-NP
for B-PP B-PP|the B-NP B-NP|planes I-NP I-NP|. O O
#
These B-NP B-NP|include B-VP B-VP|, O O|among B-PP B-PP|other B-NP B-NP|parts I-NP I-NP|, O O|each B-NP B-NP
jetliner I-NP I-NP|'s B-NP B-NP|two I-NP B-NP|major I-NP I-NP|bulkheads I-NP I-NP|, O O|a B-NP B-NP
pressure I-NP B-NP|floor I-NP I-NP|, O O|torque B-NP I-NP|box I-NP I-NP|, O O|fixed B-NP I-NP|leading I-NP I-NP
edges I-NP I-NP|for B-PP B-PP|the B-NP B-NP|wings I-NP I-NP|and O O|an B-NP B-NP|aft I-NP I-NP|keel I-NP I-NP
beam I-NP I-NP|. O O"""


def _conll2000() -> tuple[list[list[str]], list[list[str]]]:
    gold, pred = [], []
    for sentence in CONLL2000.split("\n#\n"):
        rows = [r.split() for r in sentence.replace("\n", "|").split("|")]
        gold.append([r[1] for r in rows])
        pred.append([r[2] for r in rows])
    return gold, pred


def test_agrees_with_conlleval_on_conll2000_sentences():
    """conlleval on these 78 tokens: 37 phrases, found 42, correct 31; precision 73.81%, recall 83.78%,
    FB1 78.48; NP 76.92/86.96/81.63 (found 26), PP 62.50/100.00/76.92 (8), SBAR 0/0/0 (0), VP 75/75/75 (8)."""
    gold, pred = _conll2000()
    assert sum(map(len, gold)) == 78
    s = entity_scores(gold, pred, "IOB2")
    assert s["support"] == 37
    assert s["precision"] == pytest.approx(31 / 42) and s["recall"] == pytest.approx(31 / 37)
    assert round(100 * s["f1"], 2) == 78.48
    per = {t: tuple(round(100 * v[k], 2) for k in ("precision", "recall", "f1")) for t, v in s["per_type"].items()}
    assert per == {"NP": (76.92, 86.96, 81.63), "PP": (62.5, 100.0, 76.92), "SBAR": (0.0, 0.0, 0.0),
                   "VP": (75.0, 75.0, 75.0)}


def test_scores_need_one_tag_per_word():
    with pytest.raises(ValueError, match="differ in length"):
        entity_scores([["O", "B-PER"]], [["O"]])


# ----------------------------------------------------------------------------------------------- schemes


def test_infer_scheme():
    iob2 = [["B-PER", "I-PER", "O", "B-LOC"], ["O", "B-ORG"]]
    assert infer_scheme(iob2) == ("IOB2", None)
    scheme, note = infer_scheme([["I-ORG", "O", "I-PER", "O", "O", "I-LOC", "O"]])  # CoNLL-2003 as released
    assert scheme == "IOB1" and "I-ORG at sentence 1, word 1 follows O" in note
    scheme, note = infer_scheme([["B-PER", "I-ORG"]])  # I- after another type: an IOB1 start too
    assert scheme == "IOB1" and "follows B-PER" in note
    assert infer_scheme([["S-PER", "O", "B-LOC", "I-LOC", "E-LOC"]])[0] == "BIOES"
    assert infer_scheme([["O", "O"]])[0] == "IOB2"
    assert infer_scheme(iob2, "bio") == ("IOB2", None)
    assert infer_scheme(iob2, "IOB1") == ("IOB1", None)


@pytest.mark.parametrize("tags,stated,message", [
    ([["O", "PER"]], None, "'PER' at sentence 1, word 2 is not O or B-/I-/E-/S-"),
    ([["B_PER"]], None, "'B_PER' at sentence 1, word 1"),
    ([["O"], ["O", "E-PER"]], None, "E-PER at sentence 2, word 2 follows O: a BIOES entity starts with B- or S-"),
    ([["B-PER", "O", "S-LOC"]], None, "B-PER at sentence 1, word 1 is followed by O: a BIOES entity ends with E-PER"),
    ([["O", "I-PER"]], "IOB2", "follows O: an IOB2 entity starts with B-; the tags do not follow the stated"),
    ([["S-PER"]], "IOB1", "belongs to BIOES, not IOB1"),
    ([["B-PER"]], "IOE2", "unknown tag scheme 'IOE2'"),
])
def test_inconsistent_tags_are_named(tags, stated, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        infer_scheme(tags, stated)


# ----------------------------------------------------------------------------------------------- SQuAD


def test_normalize_answer():
    """Lower case, punctuation out, whole-word articles out, whitespace collapsed (both scripts)."""
    assert squad_eval.normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert squad_eval.normalize_answer("An apple, a pear and THE end.") == "apple pear and end"
    assert squad_eval.normalize_answer("theory anathema") == "theory anathema"  # only whole words
    assert squad_eval.normalize_answer("“Paris”") == "“paris”"  # string.punctuation is ASCII only


def test_real_squad_v11_questions():
    """Two SQuAD v1.1 train questions on University_of_Notre_Dame (as allennlp 0.9.0's test fixtures ship
    them), each with the sentence of its context that holds the answer."""
    dataset = [{"title": "University_of_Notre_Dame", "paragraphs": [
        {"context": "It is a replica of the grotto at Lourdes, France where the Virgin Mary reputedly appeared to "
                    "Saint Bernadette Soubirous in 1858.",
         "qas": [{"id": "5733be284776f41900661182", "question": "To whom did the Virgin Mary allegedly appear in "
                  "1858 in Lourdes France?", "answers": [{"answer_start": 93, "text": "Saint Bernadette Soubirous"}]}]},
        {"context": "Atop the Main Building's gold dome is a golden statue of the Virgin Mary.",
         "qas": [{"id": "5733be284776f4190066117e", "question": "What sits on top of the Main Building at Notre "
                  "Dame?", "answers": [{"answer_start": 38, "text": "a golden statue of the Virgin Mary"}]}]}]}]
    for paragraph in dataset[0]["paragraphs"]:
        answer = paragraph["qas"][0]["answers"][0]
        assert paragraph["context"][answer["answer_start"]:].startswith(answer["text"])
    assert squad_eval.exact_match("the Saint Bernadette Soubirous.", ["Saint Bernadette Soubirous"]) == 1.0
    assert squad_eval.f1("Bernadette Soubirous", ["Saint Bernadette Soubirous"]) == pytest.approx(0.8)
    out = squad_eval.evaluate_v1(dataset, {"5733be284776f41900661182": "Bernadette Soubirous"})
    assert out == {"exact_match": 0.0, "f1": pytest.approx(40.0)}  # the question without a prediction scores 0
    out = squad_eval.evaluate_v1(dataset, {"5733be284776f41900661182": "Saint Bernadette Soubirous",
                                           "5733be284776f4190066117e": "golden statue"})
    # golden statue vs golden statue of virgin mary: p 1, r 2/5, F1 4/7
    assert out == {"exact_match": 50.0, "f1": pytest.approx(100 * (1 + 4 / 7) / 2)}


def test_metric_card_examples():
    """The `evaluate` library's squad and squad_v2 cards: one right answer gives 100 everywhere, and v2.0
    reports best_exact / best_f1 at threshold 0.0."""
    qa = {"id": "56e10a3be3433e1400422b22", "answers": [{"answer_start": 97, "text": "1976"}]}
    dataset = [{"paragraphs": [{"context": "", "qas": [qa]}]}]
    assert squad_eval.evaluate_v1(dataset, {qa["id"]: "1976"}) == {"exact_match": 100.0, "f1": 100.0}
    out = squad_eval.evaluate_v2(dataset, {qa["id"]: "1976"}, {qa["id"]: 0.0})
    assert out == {"exact": 100.0, "f1": 100.0, "total": 1, "HasAns_exact": 100.0, "HasAns_f1": 100.0,
                   "HasAns_total": 1, "best_exact": 100.0, "best_exact_thresh": 0.0, "best_f1": 100.0,
                   "best_f1_thresh": 0.0}


def test_empty_answers_differ_between_versions():
    """v1.1's f1 is 0 for no shared token (empty included); v2.0 counts "" for "" as right (no answer), and a
    gold answer that normalises to nothing ("The") is no answer."""
    assert squad_eval.f1_score("", "") == 0 and squad_eval.compute_f1("", "") == 1
    assert squad_eval.compute_f1("", "Paris") == 0 and squad_eval.compute_exact("", "") == 1
    assert squad_eval.f1("", [], version="2.0") == 1.0 and squad_eval.exact_match("", ["The"], version="2.0") == 1.0
    exact, f1 = squad_eval.get_raw_scores({"a": ["The"], "b": ["the cat sat"], "c": []}, {"a": "", "b": "a cat"})
    assert exact == {"a": 1, "b": 0} and f1 == {"a": 1, "b": pytest.approx(2 / 3)}  # "c": no prediction, left out
    # an empty gold beside a real one is dropped, so "" does not match it
    assert squad_eval.get_raw_scores({"d": ["The", "Paris"]}, {"d": ""}) == ({"d": 0}, {"d": 0})


def test_v2_splits_and_best_threshold():
    """Worked by hand with the v2.0 script's rules: sorted by no-answer probability q1 (0.1, has answer, F1 1),
    q2 (0.3, no answer, predicted text: -1), q3 (0.6, has answer, F1 0.5), q4 (0.9, no answer, predicted "")."""
    golds = {"q1": ["Denver Broncos"], "q2": [], "q3": ["Super Bowl 50"], "q4": []}
    preds = {"q1": "Denver Broncos", "q2": "Carolina", "q3": "Super Bowl", "q4": ""}
    na = {"q1": 0.1, "q2": 0.3, "q3": 0.6, "q4": 0.9}
    has = {q: bool(g) for q, g in golds.items()}
    exact, f1 = squad_eval.get_raw_scores(golds, preds)
    assert f1["q3"] == pytest.approx(0.8)  # super bowl vs super bowl 50: p 1, r 2/3
    # running totals from 2 (both no-answers right): q1 -> 3, q2 -> 2, q3 -> 2.8, q4 -> 2.8
    assert squad_eval.find_best_thresh(preds, f1, na, has) == (pytest.approx(75.0), 0.1)
    assert squad_eval.find_best_thresh(preds, exact, na, has) == (75.0, 0.1)
    dataset = [{"paragraphs": [{"context": "", "qas": [
        {"id": q, "answers": [{"text": t, "answer_start": 0} for t in g]} for q, g in golds.items()]}]}]
    out = squad_eval.evaluate_v2(dataset, preds, na, na_prob_thresh=0.5)  # q3, q4 answered ""
    assert (out["exact"], out["f1"], out["total"]) == (50.0, 50.0, 4)
    assert (out["HasAns_exact"], out["NoAns_exact"], out["HasAns_total"], out["NoAns_total"]) == (50.0, 50.0, 2, 2)
    assert (out["best_f1"], out["best_f1_thresh"]) == (pytest.approx(75.0), 0.1)
    assert squad_eval.evaluate_v2(dataset, preds)["NoAns_exact"] == 50.0  # no probabilities: every text kept


# ----------------------------------------------------------------------------------------------- v2.0 threshold
def test_v2_threshold_on_logit_differences_can_choose_never():
    """Logit differences (no-answer score minus best span's) are mostly negative: when answering nothing is
    best, every question stays unanswered, the threshold below them all (the official script's 0.0 start would
    answer all three: F1 0)."""
    golds = (("Paris",), (), ())
    out = span.answer_metrics(golds, {0: "London", 1: "x", 2: "y"}, {0: -3.0, 1: -1.0, 2: -2.0}, "2.0")
    assert out["f1"] == pytest.approx(2 / 3) and out["exact"] == pytest.approx(2 / 3)
    assert out["null_threshold"] < -3.0


def test_v2_threshold_keeps_ties_together_and_reproduces_its_score():
    """Equal differences are answered together: two right answers and a wrong one at -1 (gain 1 + 1 - 1) beat
    never answering, and the threshold lies strictly between -1 and the next difference, so applying it gives the
    F1 it reports (a threshold at a tied value, as the official walk may leave, answers a different set)."""
    golds = (("Paris",), ("Rome",), (), ())
    texts = {0: "Paris", 1: "Rome", 2: "z", 3: "w"}
    out = span.answer_metrics(golds, texts, {0: -1.0, 1: -1.0, 2: -1.0, 3: 4.0}, "2.0")
    assert -1.0 < out["null_threshold"] < 4.0 and out["f1"] == pytest.approx(3 / 4)
    # a tie whose group gains nothing is not split for the right answer inside it
    out = span.answer_metrics(golds[:1] + golds[2:3], {0: "Paris", 1: "z"}, {0: 2.0, 1: 2.0}, "2.0")
    assert out["null_threshold"] < 2.0 and out["f1"] == pytest.approx(1 / 2)


def test_v2_threshold_never_below_always_or_never_answering():
    """On dev sets where most questions are unanswerable, the chosen threshold scores at least the better of
    always and never answering (both are candidates), and `null_threshold` answers exactly the questions at or
    below it."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 12))
        golds = tuple(("a b",) if rng.random() < 0.3 else () for _ in range(n))
        texts = {q: str(rng.choice(["a b", "a", "c"])) for q in range(n)}
        diff = {q: float(rng.choice([-2.0, -1.0, -0.5, 0.0, 1.5])) for q in range(n)}
        got = span.answer_metrics(golds, texts, diff, "2.0")["f1"]
        never = np.mean([not g for g in golds])
        always = np.mean([squad_eval.f1(texts[q], list(golds[q]), "2.0") for q in range(n)])
        assert got >= max(never, always) - 1e-12


def test_span_baseline_picks_never_when_most_questions_have_no_answer():
    """The one-rule baseline is 'the better of always and never answering': never, here (2 of 3 unanswerable)."""
    golds = (("Paris",), (), ())
    assert span.answer_metrics(golds, {0: "London", 1: "x", 2: "y"}, {0: 0.0, 1: 0.0, 2: 0.0}, "2.0")["f1"] == \
        pytest.approx(2 / 3)
