"""The corpus stage's quality rules by name: their published thresholds, what a user may set them to, and
`corpus.filters` parsed into {rule: threshold}.

The thresholds are datatrove 0.10's defaults, which are Gopher's (Rae et al. 2021, App. A, Table A1), C4's
(Raffel et al. 2020, §2.2, and its reference code `c4_utils.py`) and FineWeb's (Penedo et al. 2024, §3.3). How a
rule measures a document is `stages.corpus.quality`'s; this module is plain data, so the config checks a setting
before Ray starts (`core.config.CorpusConfig.check`) without importing the stage.

`corpus.filters` is a list read left to right: a group name (`gopher_quality`, `gopher_repetition`, `c4`,
`fineweb`, or `all`) turns on each of its rules at the published threshold; `RULE=VALUE` sets one rule (turning it
on); `RULE=off` or `GROUP=off` turns it off. E.g. `corpus.filters=all,c4=off,gopher_min_words=20`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from core.errors import ConfigError

MIN, MAX, SWITCH, LINE = "min", "max", "switch", "line"


@dataclass(frozen=True)
class Rule:
    name: str
    group: str
    default: float
    kind: str
    """MIN: removed below the threshold; MAX: removed above it; SWITCH: removed when found (no threshold);
    LINE: a C4 line rule, deciding which lines count for c4_min_sentences (removes no document itself)."""
    low: float = 0.0
    high: float = 1.0
    integer: bool = False
    what: str = ""

    def fires(self, value, threshold):
        """Where the rule removes a document whose measure is `value` (numpy arrays)."""
        if self.kind == MIN:
            return value < threshold
        if self.kind == MAX:
            return value > threshold
        return value > 0


def _ratio(name: str, group: str, default: float, kind: str, what: str) -> Rule:
    return Rule(name, group, default, kind, what=what)


INF = float("inf")
GROUPS = ("gopher_repetition", "gopher_quality", "c4", "fineweb")
"""In the order FineWeb's pipeline applies them (Penedo et al. 2024, §3): a document's reason is the first that
fires."""

RULES: tuple[Rule, ...] = (
    # Gopher repetition (Rae et al. 2021, Table A1): document-level repetition of lines, paragraphs and n-grams.
    _ratio("gopher_dup_paragraphs", "gopher_repetition", 0.3, MAX, "duplicate paragraphs / paragraphs"),
    _ratio("gopher_dup_paragraph_chars", "gopher_repetition", 0.2, MAX, "characters in duplicate paragraphs / characters"),
    _ratio("gopher_dup_lines", "gopher_repetition", 0.3, MAX, "duplicate lines / lines"),
    _ratio("gopher_dup_line_chars", "gopher_repetition", 0.2, MAX, "characters in duplicate lines / characters"),
    *(_ratio(f"gopher_top_{n}gram", "gopher_repetition", f, MAX,
             f"characters of the most frequent {n}-gram x its count / characters")
      for n, f in ((2, 0.2), (3, 0.18), (4, 0.16))),
    *(_ratio(f"gopher_dup_{n}gram", "gopher_repetition", f, MAX,
             f"characters in duplicated {n}-grams / characters")
      for n, f in ((5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.10))),
    # Gopher quality (Rae et al. 2021, App. A.1.1).
    Rule("gopher_min_words", "gopher_quality", 50, MIN, 0, INF, True, "words that are not only punctuation"),
    Rule("gopher_max_words", "gopher_quality", 100_000, MAX, 1, INF, True, "words that are not only punctuation"),
    Rule("gopher_min_mean_word_length", "gopher_quality", 3, MIN, 0, INF, False, "mean characters per word"),
    Rule("gopher_max_mean_word_length", "gopher_quality", 10, MAX, 0, INF, False, "mean characters per word"),
    _ratio("gopher_hash_ratio", "gopher_quality", 0.1, MAX, "'#' / words"),
    _ratio("gopher_ellipsis_ratio", "gopher_quality", 0.1, MAX, "'...' and '…' / words"),
    _ratio("gopher_bullet_lines", "gopher_quality", 0.9, MAX, "lines starting with a bullet / lines"),
    _ratio("gopher_ellipsis_lines", "gopher_quality", 0.3, MAX, "lines ending with an ellipsis / lines"),
    _ratio("gopher_alpha_words", "gopher_quality", 0.8, MIN, "words with a letter / words"),
    Rule("gopher_stop_words", "gopher_quality", 2, MIN, 0, 8, True,
         "distinct stop words of {the, be, to, of, and, that, have, with}"),
    # C4 (Raffel et al. 2020, §2.2): lines that count, then the document.
    Rule("c4_line_max_word_length", "c4", 1000, LINE, 1, INF, True, "a line with a longer word does not count"),
    Rule("c4_line_terminal_punct", "c4", 1, LINE, what="a line not ending in . ? ! \" ' (or ending in ...) does "
                                                         "not count"),
    Rule("c4_line_min_words", "c4", 3, LINE, 0, INF, True, "a line with fewer words does not count"),
    Rule("c4_line_javascript", "c4", 1, LINE, what="a line naming javascript does not count"),
    Rule("c4_line_policy", "c4", 1, LINE, what="a line naming terms of use, privacy or cookie policy does not count"),
    Rule("c4_lorem_ipsum", "c4", 1, SWITCH, what="'lorem ipsum' in a counted line"),
    Rule("c4_curly_brace", "c4", 1, SWITCH, what="'{' in a counted line"),
    Rule("c4_min_sentences", "c4", 5, MIN, 0, INF, True, "sentences in the lines that count"),
    # FineWeb (Penedo et al. 2024, §3.3), over the non-empty lines.
    _ratio("fineweb_line_punct", "fineweb", 0.12, MIN, "lines ending in terminal punctuation / lines"),
    _ratio("fineweb_short_lines", "fineweb", 0.67, MAX, "lines of at most 30 characters / lines"),
    _ratio("fineweb_dup_line_chars", "fineweb", 0.01, MAX, "characters in duplicate lines / characters"),
    Rule("fineweb_list_ratio", "fineweb", 0.3, MAX, 0, INF, False, "newlines / words"),
)
BY_NAME = {r.name: r for r in RULES}
_ON_OFF = {r.name for r in RULES if r.low == 0 and r.high == 1 and r.kind in (SWITCH, LINE)}


def group_rules(group: str) -> tuple[Rule, ...]:
    return tuple(r for r in RULES if r.group == group or group == "all")


def _value(item: str, rule: Rule, text: str) -> float:
    if rule.name in _ON_OFF:
        raise ConfigError(f"corpus.filters: {item!r}: {rule.name} is on or off (name it, or {rule.name}=off)")
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"corpus.filters: {item!r}: expected a number (or off), e.g. {rule.name}={rule.default:g}")
    if not rule.low <= value <= rule.high or (rule.integer and value != int(value)):
        bounds = f"in [{rule.low:g}, {rule.high:g}]" if rule.high < INF else f">= {rule.low:g}"
        raise ConfigError(f"corpus.filters: {item!r}: {rule.name} ({rule.what}) must be "
                          f"{'a whole number ' if rule.integer else ''}{bounds}")
    return value


def resolve(items: tuple[str, ...]) -> dict[str, float]:
    """`corpus.filters` as {rule: threshold} of the rules on, in RULES order; ConfigError naming a bad item."""
    on: dict[str, float] = {}
    for item in items:
        name, eq, text = (s.strip() for s in item.partition("="))
        if name in GROUPS or name == "all":
            for rule in group_rules(name):
                on.pop(rule.name, None) if text == "off" else on.setdefault(rule.name, rule.default)
            if eq and text != "off":
                raise ConfigError(f"corpus.filters: {item!r}: a group is named alone (its published thresholds) "
                                  f"or {name}=off; set one rule with RULE=VALUE")
            continue
        rule = BY_NAME.get(name)
        if rule is None:
            raise ConfigError(f"corpus.filters: unknown rule {name!r}; use a group ({', '.join(GROUPS)}, all) or a "
                              f"rule: {', '.join(BY_NAME)}")
        if text == "off":
            on.pop(name, None)
        else:
            on[name] = _value(item, rule, text) if eq else rule.default
    return {r.name: float(on[r.name]) for r in RULES if r.name in on}


@lru_cache(maxsize=1)
def language_codes() -> tuple[str, ...]:
    """The languages py3langid tells apart (its model ships inside its wheel: nothing is downloaded)."""
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    return tuple(LanguageIdentifier.from_model_file(MODEL_FILE).labels)
