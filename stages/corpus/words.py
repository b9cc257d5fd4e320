"""Words as spaCy's English tokenizer splits them (datatrove's word splitter), over a batch's distinct pieces at once.

spaCy (`Tokenizer._split_affixes` and `_attach_tokens`) splits a white-space piece by peeling prefixes off its
front and suffixes off its back, then cutting what is left (the core) at its infixes, with the English rules of
spacy.lang.punctuation. Here those rules are evaluated on the code points of every distinct piece of a batch at
once, in numpy: each rule is a class of characters (a bit of CLASSES) and the one or two characters beside it, so
a piece's words are the cuts between its characters, and the words are slices of the batch's own UTF-8 buffer.
Written by hand because spaCy runs its rules piece by piece in Python's `regex` (microseconds a piece: more than
the whole budget of the rules), and pyarrow's RE2 compiles a pattern with Unicode classes anew at every call
(milliseconds, more than the rest of a batch's work).

Where this differs from spaCy: its tokenizer exceptions are not applied (contractions, abbreviations, emoticons:
"don't" and "e.g." split as any word, "):" is two words where spaCy keeps one); a piece's prefixes are all peeled
before its suffixes, where spaCy alternates; lower and upper case letters are Unicode's Ll and Lu, with the
uncased scripts (Lo) in both, where spaCy lists script ranges; a URL is spaCy's URL_MATCH without its private-IP
look-aheads. With spaCy's exceptions turned off, the two give the same words for every document the referee
compares (`python -m bench.corpus_filters`, "Corpus filters against datatrove" in bench/README.md, which also says
how often datatrove's rules decide otherwise with this splitter).
"""

from __future__ import annotations

import re
import unicodedata

import numpy as np
import pyarrow as pa

PUNCT = "…,:;!?¿؟¡()[]{}<>_#*&。？！，、；：～·।،۔؛٪"  # spaCy's LIST_PUNCT, one character each
QUOTES = "'\"”“`‘´’‚,„»«「」『』（）〔〕【】《》〈〉〈〉⟦⟧"  # LIST_QUOTES
CURRENCY = "$£€¥฿₽﷼₴₠₡₢₣₤₥₦₧₨₩₪₫₭₮₯₰₱₲₳₵₶₷₸₹₺₻₼₾₿"  # LIST_CURRENCY, but US$ C$ A$
MULTI_PREFIXES = ("US$", "C$", "A$")
# a suffix after a digit (spaCy's units and currencies)
AFTER_DIGIT = frozenset("km km² km³ m m² m³ dm dm² dm³ cm cm² cm³ mm mm² mm³ ha µm nm yd in ft kg g mg µg t lb oz m/s "
                        "km/h kmh mph hPa Pa mbar mb MB kb KB gb GB tb TB T G M K % км км² км³ м м² м³ дм дм² дм³ см "
                        "см² см³ мм мм² мм³ нм кг г мг м/с км/ч кПа Па мбар Кб КБ кб Мб МБ мб Гб ГБ гб Тб ТБ тб + "
                        "US$ C$ A$".split()) | frozenset(CURRENCY)
SUFFIX_PAIRS = ("'s", "'S", "’s", "’S", "……")
# URL_MATCH, but its look-aheads for private IP addresses; its top-level domain in lower case is checked after
URL = re.compile(r"^(?:[\w+\-.]{2,}://)?(?:\S+(?::\S*)?@)?(?:[0-9]{1,3}(?:\.[0-9]{1,3}){3}|"
                 r"(?:(?:[^\W_][\w\-]{0,62})?[^\W_]\.)+(?P<tld>[^\W\d_]{2,63}))(?::[0-9]{2,5})?(?:[/?#]\S*)?$")

# Classes of characters, a bit each.
PREFIX, SUFFIX, DOT_AFTER, LOWER, UPPER, ALPHA, QUOTE, ICON, DIGIT, INFIX, SUFFIX_RUN, DOT = (1 << i for i in range(12))


def _classes(code: int) -> int:
    char, kind = chr(code), unicodedata.category(chr(code))
    bits = ICON * (kind == "So") | DIGIT * ("0" <= char <= "9") | QUOTE * (char in QUOTES) | DOT * (char == ".")
    bits |= LOWER * (kind in ("Ll", "Lo")) | UPPER * (kind in ("Lu", "Lo")) | ALPHA * kind.startswith("L")
    if char in "§%=—–" + PUNCT + QUOTES + CURRENCY or kind == "So":
        bits |= PREFIX
    if char in PUNCT + QUOTES + "—–" or kind == "So":
        bits |= SUFFIX
        bits |= SUFFIX_RUN * (char != "…")  # a run of these ends in as many suffixes ("……" is one)
    if bits & (DIGIT | LOWER) or char in "%²-+|(?:)" + PUNCT + QUOTES:  # what a "." suffix may follow
        bits |= DOT_AFTER
    if char in ".…+-*^,–—~:<>=/" or kind == "So":  # what an infix starts with
        bits |= INFIX
    return bits


CLASSES = np.array([_classes(c) for c in range(0x10000)], np.uint16)  # the Basic Multilingual Plane; others lazily


def _decode(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(code points, the byte each starts at) of UTF-8 bytes."""
    starts = np.flatnonzero((data & 0xC0) != 0x80)
    code = data[starts].astype(np.uint32)
    multi = np.flatnonzero(code >= 0x80)  # the rest are ASCII, their own code points
    if len(multi):
        size = np.diff(np.r_[starts, len(data)])[multi]
        value = code[multi] & np.where(size == 2, 0x1F, np.where(size == 3, 0x0F, 0x07)).astype(np.uint32)
        for k in (1, 2, 3):
            more = size > k
            value[more] = (value[more] << 6) | (data[starts[multi[more]] + k] & 0x3F)
        code[multi] = value
    return code, starts


def _class_of(code: np.ndarray) -> np.ndarray:
    bits = CLASSES[np.minimum(code, 0xFFFF)]
    astral = code > 0xFFFF
    if astral.any():
        values, at = np.unique(code[astral], return_inverse=True)
        bits[astral] = np.array([_classes(int(v)) for v in values], np.uint16)[at]
    return bits


class _Pieces:
    """The code points of a batch's pieces end to end: `code` (C,), `bits` (C,) their classes, `byte` (C,) where
    each starts in the UTF-8 buffer, `start`/`end` (P,) each piece's first and past-last code point."""

    def __init__(self, pieces: pa.Array):
        offsets = np.frombuffer(pieces.buffers()[1], np.int32, len(pieces) + 1, pieces.offset * 4)
        self.base, self.size, self.data_buffer = int(offsets[0]), int(offsets[-1] - offsets[0]), pieces.buffers()[2]
        data = np.frombuffer(self.data_buffer, np.uint8)[offsets[0]:offsets[-1]] if len(pieces) else \
            np.zeros(0, np.uint8)
        self.code, self.byte = _decode(data)
        self.bits = _class_of(self.code)
        bounds = np.searchsorted(self.byte, offsets - offsets[0])
        self.start, self.end = bounds[:-1], bounds[1:]

    def piece(self, position: np.ndarray) -> np.ndarray:
        """The piece of each code point at `position`."""
        return np.searchsorted(self.end, position, "right")

    def at(self, position: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The classes at `position`, 0 outside [lo, hi)."""
        inside = (position >= lo) & (position < hi)
        return np.where(inside, self.bits[np.clip(position, 0, max(len(self.bits) - 1, 0))], 0)

    def char(self, position: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The code points at `position`, 0 outside [lo, hi)."""
        inside = (position >= lo) & (position < hi)
        return np.where(inside, self.code[np.clip(position, 0, max(len(self.code) - 1, 0))], 0)

    def text(self, lo: int, hi: int) -> str:
        return "".join(map(chr, self.code[lo:hi].tolist()))


def _tail_key(codes: list[np.ndarray]) -> np.ndarray:
    """A key of up to 4 characters of the Basic Multilingual Plane, 16 bits each (astral: matches nothing)."""
    key = np.zeros(len(codes[0]), np.uint64)
    for k, code in enumerate(codes):
        key |= np.where(code > 0xFFFF, np.uint64(0xFFFF), code).astype(np.uint64) << np.uint64(16 * k)
    return key


AFTER_DIGIT_KEYS = {k: np.array(sorted(int(_tail_key([np.array([ord(c)], np.uint32) for c in text])[0])
                                       for text in AFTER_DIGIT if len(text) == k), np.uint64) for k in (1, 2, 3, 4)}


def _run_length(p: _Pieces, pos: np.ndarray, step: int, lo: np.ndarray, hi: np.ndarray, flag: int) -> np.ndarray:
    """(R,) how many characters from `pos` on (`step` 1: forward, -1: backward) inside [lo, hi) have `flag`,
    looked at 16 at a time (a rule line of "=" or "*" is a run of 80 prefixes)."""
    n, rows, ahead = np.zeros(len(pos), np.int64), np.arange(len(pos)), np.arange(16)
    while len(rows):
        window = pos[rows, None] + step * (n[rows, None] + ahead)
        count = np.cumprod((p.at(window, lo[rows, None], hi[rows, None]) & flag) > 0, axis=1).sum(axis=1)
        n[rows] += count
        rows = rows[count == len(ahead)]
    return n


def _prefixes(p: _Pieces, cuts: list[np.ndarray]) -> np.ndarray:
    """(P,) where each piece's rest starts: past its leading run of prefixes, each a word (cut after it)."""
    at = p.start.copy()
    first = p.char(p.start, p.start, p.end)  # a first look: what a prefix starts with
    rows = np.flatnonzero(((p.at(p.start, p.start, p.end) & PREFIX) > 0) | np.isin(first, [ord(c) for c in "+.UCA"]))
    while len(rows):
        pos, end = at[rows], p.end[rows]
        char = p.char(pos, pos, end)
        nxt = p.char(pos + 1, pos, end)
        # a run of one-character prefixes (a word each); a "+" but before a digit; a run of dots; US$, C$, A$
        size = ((char == ord("+")) & ~((p.at(pos + 1, pos, end) & DIGIT) > 0)).astype(np.int64)
        run = (p.at(pos, pos, end) & PREFIX) > 0
        if run.any():
            length = _run_length(p, pos[run], 1, pos[run], end[run], PREFIX)
            cuts.append(np.repeat(pos[run], length) + np.arange(int(length.sum())) - np.repeat(
                np.cumsum(length) - length, length) + 1)
            size[run] = length
        dots = (char == ord(".")) & (nxt == ord("."))
        if dots.any():
            size[dots] = _run_length(p, pos[dots], 1, pos[dots], end[dots], DOT)
        for text in MULTI_PREFIXES:
            match = size == 0
            for k, c in enumerate(text):
                match &= p.char(pos + k, pos, end) == ord(c)
            size[match] = len(text)
        rows, stop = rows[size > 0], (pos + size)[size > 0]
        cuts.append(stop)
        at[rows] = stop
    return at


def _suffix_lengths(p: _Pieces, lo: np.ndarray, end: np.ndarray) -> np.ndarray:
    """(R,) code points of the suffix ending at `end` of each rest [lo, end) (0: none); the longest that fits is
    spaCy's leftmost match."""
    char = [p.char(end - k, lo, end) for k in (1, 2, 3, 4)]  # the last, the one before, ...
    before = p.at(end - 2, lo, end)
    n = ((p.at(end - 1, lo, end) & SUFFIX) > 0).astype(np.int64)
    for pair in SUFFIX_PAIRS:
        n[(char[1] == ord(pair[0])) & (char[0] == ord(pair[1]))] = 2
    dot = char[0] == ord(".")
    runs = dot & (char[1] == ord("."))  # a run of dots, one suffix
    if runs.any():
        n[runs] = _run_length(p, end[runs] - 1, -1, lo[runs], end[runs], DOT)
    after = (before & DOT_AFTER) > 0
    after |= (char[2] == ord("°")) & np.isin(char[1], [ord(c) for c in "FfCcKk"])
    after |= ((p.at(end - 3, lo, end) & UPPER) > 0) & ((before & UPPER) > 0)
    n[dot & ~runs & after] = 1
    for k in (1, 2, 3, 4):  # after a digit: a unit, a currency, a "+" (the longest)
        unit = ((p.at(end - k - 1, lo, end) & DIGIT) > 0) & (n < k)
        unit[unit] = np.isin(_tail_key([c[unit] for c in char[:k][::-1]]), AFTER_DIGIT_KEYS[k])
        n[unit] = k
    return n


def _suffixes(p: _Pieces, rest: np.ndarray, cuts: list[np.ndarray]) -> np.ndarray:
    """(P,) where each piece's core ends: before its suffixes, each a word (cut before it)."""
    at = p.end.copy()
    # may end in a suffix (a first look): not in a letter, or in 's, or soon after a digit
    maybe = (p.at(p.end - 1, rest, p.end) & ALPHA) == 0
    maybe |= np.isin(p.char(p.end - 2, rest, p.end), [ord("'"), ord("’")])
    for k in range(2, 6):
        maybe |= (p.at(p.end - k, rest, p.end) & DIGIT) > 0
    rows = np.flatnonzero(maybe & (p.end > rest))
    while len(rows):
        lo, end = rest[rows], at[rows]
        run = (p.at(end - 1, lo, end) & SUFFIX_RUN) > 0  # a run of one-character suffixes, a word each
        n = np.zeros(len(rows), np.int64)
        if run.any():
            n[run] = _run_length(p, end[run] - 1, -1, lo[run], end[run], SUFFIX_RUN)
            cuts.append(np.repeat(end[run], n[run]) - np.arange(int(n[run].sum())) + np.repeat(
                np.cumsum(n[run]) - n[run], n[run]) - 1)
        if (~run).any():
            n[~run] = _suffix_lengths(p, lo[~run], end[~run])
        rows, stop, lo, run = rows[n > 0], (end - n)[n > 0], lo[n > 0], run[n > 0]
        cuts.append(stop[~run])
        at[rows] = stop
        rows = rows[stop > lo]
    return at


def _infixes(p: _Pieces, lo: np.ndarray, hi: np.ndarray, cuts: list[np.ndarray]) -> None:
    """Cut each core [lo, hi) before and after its infixes, found as `re.finditer` finds them (a core that is a URL
    is left whole)."""
    at = np.flatnonzero(p.bits & INFIX)  # the characters an infix starts with
    piece = p.piece(at)
    core_lo, core_hi = lo[piece], hi[piece]
    keep = (at > core_lo) & (at < core_hi)  # an infix at the core's first character is skipped (spaCy's too)
    at, piece, core_lo, core_hi = at[keep], piece[keep], core_lo[keep], core_hi[keep]
    code, bits = p.code[at], p.bits[at]
    prev, prev_char = p.at(at - 1, core_lo, core_hi), p.char(at - 1, core_lo, core_hi)
    follow = [p.char(at + k, core_lo, core_hi) for k in (1, 2)]
    alpha_at = [(p.at(at + k, core_lo, core_hi) & ALPHA) > 0 for k in (1, 2, 3)]
    length = np.zeros(len(at), np.int64)
    dot = code == ord(".")
    runs = dot & (follow[0] == ord(".")) & (prev_char != ord("."))  # a run of dots starts: one infix
    if runs.any():
        length[runs] = _run_length(p, at[runs], 1, core_lo[runs], core_hi[runs], DOT)
    length[(code == ord("…")) | ((bits & ICON) > 0)] = 1
    digit_op = np.isin(code, [ord(c) for c in "+-*^"]) & ((prev & DIGIT) > 0) & \
        (((p.at(at + 1, core_lo, core_hi) & DIGIT) > 0) | (follow[0] == ord("-")))
    length[digit_op & (length == 0)] = 1
    upper_next = (p.at(at + 1, core_lo, core_hi) & (UPPER | QUOTE)) > 0
    length[dot & (prev_char != ord(".")) & ((prev & (LOWER | QUOTE)) > 0) & upper_next] = 1
    length[(code == ord(",")) & ((prev & ALPHA) > 0) & alpha_at[0]] = 1
    word_before = (prev & (ALPHA | DIGIT)) > 0
    hyphen = np.zeros(len(at), np.int64)
    for text in ("-", "–", "—", "--", "---", "——", "~"):  # the first that fits, as the regex's alternation
        fits = (hyphen == 0) & alpha_at[len(text) - 1] & (code == ord(text[0]))
        for k, c in enumerate(text[1:]):
            fits &= follow[k] == ord(c)
        hyphen[fits] = len(text)
    take = (length == 0) & word_before & (hyphen > 0)
    length[take] = hyphen[take]
    length[(length == 0) & np.isin(code, [ord(c) for c in ":<>=/"]) & word_before & alpha_at[0]] = 1
    found = length > 0
    # a URL's last label is two or more lower case letters after a dot: a first look
    lower = [(p.at(at + k, core_lo, core_hi) & LOWER) > 0 for k in (1, 2)]
    tld = dot & lower[0] & lower[1]
    dotted = np.intersect1d(piece[found], piece[tld])
    found &= ~np.isin(piece, _urls(p, lo, hi, dotted))
    cuts.append(at[found])
    cuts.append(at[found] + length[found])


def _urls(p: _Pieces, lo: np.ndarray, hi: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The rows whose core [lo, hi) is a URL, of `rows` (a few: those with a dot and two letters after it)."""
    found = [URL.match(p.text(lo[r], hi[r])) for r in rows.tolist()]
    return rows[[bool(m) and (m["tld"] is None or m["tld"] == m["tld"].lower()) for m in found]]


def _cuts(pieces: pa.Array) -> tuple[_Pieces, np.ndarray, np.ndarray]:
    """The pieces' code points, where a word starts (ascending: each piece's start, and each cut in it), and where
    each piece's words start among those (P + 1,)."""
    p = _Pieces(pieces if pieces.type == pa.string() else pieces.cast(pa.string()))
    cuts = [p.start]
    rest = _prefixes(p, cuts)
    core_end = _suffixes(p, rest, cuts)
    _infixes(p, rest, core_end, cuts)
    starts = np.zeros(len(p.code) + 1, bool)  # a word starts here (a flag per code point: cheaper than np.unique)
    starts[np.concatenate(cuts)] = True
    cut = np.flatnonzero(starts[:-1])
    return p, cut, np.r_[np.searchsorted(cut, p.start), len(cut)]


def split(pieces: pa.Array) -> pa.ListArray:
    """Each piece (no white space in it) as its list of words: slices of the pieces' own buffer."""
    p, cut, first = _cuts(pieces)
    offsets = (np.r_[p.byte[cut], p.size] + p.base).astype(np.int32)
    words = pa.StringArray.from_buffers(len(cut), pa.py_buffer(offsets), p.data_buffer)
    return pa.ListArray.from_arrays(pa.array(first.astype(np.int32)), words)


def counts(pieces: pa.Array) -> np.ndarray:
    """(P,) words in each piece, as `split` splits it."""
    return np.diff(_cuts(pieces)[2])
