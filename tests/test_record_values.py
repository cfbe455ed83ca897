"""A record's values reach Hydra only as text this project writes from typed values (`records.emit`): properties over
generated values and generated record text."""

import math
from dataclasses import replace

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Quote, QuotedString, RangeSweep
from hypothesis import given, settings
from hypothesis import strategies as st

from src import records

PARSER = OverridesParser.create()
TEXT = st.text(st.characters(blacklist_characters="'\"\\$", blacklist_categories=("Cc", "Cs")), max_size=12)
NUMBERS = st.one_of(st.integers(-10**12, 10**12), st.floats(allow_nan=True, allow_infinity=True))
SCALARS = st.one_of(NUMBERS, st.booleans(), st.none(), TEXT,
                    st.sampled_from(["x", "true", "NULL", "1e3", "00", "inf", "16-mixed", "a b", "café"]))
QUOTED = st.builds(QuotedString, text=TEXT, quote=st.sampled_from([Quote.single, Quote.double]))
WHOLE = st.integers(-1000, 1000)
FINITE = st.floats(-1e6, 1e6, allow_nan=False)


def as_swept(item):
    """An item of `a,b`: Hydra keeps a quoted one quoted there, so text that needs quotes is a QuotedString."""
    bare = isinstance(item, str) and records.emit(item)[:1] not in "'\""
    return item if bare or not isinstance(item, str) else QuotedString(text=item, quote=Quote.single)


SWEEPS = st.one_of(
    st.builds(lambda items: ChoiceSweep(list=[as_swept(i) for i in items], simple_form=True),
              st.lists(st.one_of(SCALARS, QUOTED), min_size=2, max_size=4)),
    st.builds(lambda items: ChoiceSweep(list=items), st.lists(SCALARS.filter(lambda v: v is not None), min_size=1,
                                                              max_size=4)),
    st.builds(lambda a, b, step: RangeSweep(start=a, stop=b, step=step), st.one_of(WHOLE, FINITE),
              st.one_of(WHOLE, FINITE), st.one_of(st.integers(1, 5), st.floats(0.5, 4))),
    st.builds(lambda a, b, log: IntervalSweep(start=float(a), end=float(b), tags={"log"} if log else set()), FINITE,
              FINITE, st.booleans()),
    st.builds(lambda a, b, log: IntervalSweep(start=a, end=b, tags={"log"} if log else set()), WHOLE, WHOLE,
              st.booleans()),
)
SHUFFLED = st.one_of(
    st.builds(lambda items, simple: ChoiceSweep(list=items, simple_form=simple, shuffle=True),
              st.lists(SCALARS.filter(lambda v: v is not None), min_size=2, max_size=4), st.booleans()),
    st.builds(lambda a, b, step: RangeSweep(start=a, stop=b, step=step, shuffle=True), WHOLE, WHOLE,
              st.integers(1, 5)),
)
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=4), SWEEPS, SHUFFLED)


def same(a, b) -> bool:
    """Equal as Hydra's values, types included: nan is nan, 1 is not 1.0 or True, a quoted text is its quote too."""
    if isinstance(a, (ChoiceSweep, RangeSweep, IntervalSweep)) or isinstance(b, (ChoiceSweep, RangeSweep, IntervalSweep)):
        return type(a) is type(b) and all(same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return type(a) is type(b) and a == b


def hydra_reads(text: str):
    """What Hydra's parser makes of `key=<text>`; a quoted text inside `choice()` or a list is plain text to it."""
    return PARSER.parse_override(f"key={text}").value()


def unquoted(value):
    """Hydra's reading of a choice() or a list: their quoted items are plain text."""
    if isinstance(value, ChoiceSweep) and not value.simple_form:
        return replace(value, list=[getattr(v, "text", v) for v in value.list])
    return value


@settings(max_examples=600, deadline=None)
@given(value=VALUES)
def test_every_value_written_out_reads_back_in_hydra_and_here_as_that_value(value):
    """Each type a record holds, emitted: Hydra's parser reads exactly that value (its type, its quotes), and so does
    the records' own reader, so a value survives any number of resumes unchanged."""
    text = records.emit(value)
    assert same(hydra_reads(text), unquoted(value)), text
    assert same(records.value_of(text, sweep=True), unquoted(value)), text
    assert records.emit(records.value_of(text, sweep=True)) == text


RECORD_TEXT = st.one_of(
    st.from_regex(r"[ -~]{1,14}", fullmatch=True),
    st.lists(st.sampled_from(["1", "0.10", "1_000", "True", "null", "x", "'a b'", '"w"', "00", "-2", ".5", "1e-3"]),
             min_size=1, max_size=4).map(",".join),
    st.tuples(st.sampled_from(["interval", "int(interval", "tag(log, interval", "tag(log, int(interval", "range",
                               "choice", "shuffle", "shuffle(choice", "shuffle(range"]),
              st.lists(st.sampled_from(["1", "5", "0.5", "1e-3", "x", "step=2", "start=2", "stop=4", "-3", "10",
                                        "'a,b'"]), min_size=1, max_size=3))
    .map(lambda call: f"{call[0]}({', '.join(call[1])})" + ")" * call[0].count("(")),
)


@settings(max_examples=600, deadline=None)
@given(text=RECORD_TEXT)
def test_a_swept_record_value_taken_names_the_same_jobs_as_the_text_it_was_read_from(text):
    """What a sweep's record held, read and written out again, is what Hydra read from the record itself: the same
    value, and the same job strings (a job's folder is named by them, so a resume finds the folders it made)."""
    try:
        value = records.value_of(text, sweep=True)
    except ValueError:
        return
    if records.swept_count(value) > 1000:
        return
    emitted, original = PARSER.parse_override(f"key={records.emit(value)}"), PARSER.parse_override(f"key={text}")
    assert same(emitted.value(), original.value()), text
    if original.is_sweep_override() and not original.is_interval_sweep():  # shuffle() draws its order each time
        ordered = sorted if getattr(original.value(), "shuffle", False) else list
        assert ordered(emitted.sweep_string_iterator()) == ordered(original.sweep_string_iterator())


FUNCTIONS = ["shuffle", "sort", "choice", "range", "interval", "int", "float", "str", "tag", "glob"]
OVERRIDE_TEXT = st.one_of(
    RECORD_TEXT,
    st.recursive(st.sampled_from(["1", "x", "'a,b'", "[1,2]", "{a:1}", "x\\,y", "reverse=true", "log", " 2 ", "*"]),
                 lambda inner: st.one_of(st.lists(inner, min_size=1, max_size=3).map(",".join),
                                         st.tuples(st.sampled_from(FUNCTIONS), st.lists(inner, max_size=3))
                                         .map(lambda call: f"{call[0]}({','.join(call[1])})")),
                 max_leaves=6),
)


@settings(max_examples=600, deadline=None)
@given(text=OVERRIDE_TEXT)
def test_a_key_hydra_would_sweep_names_the_job_folders(text):
    """Job folders are named by the keys `naming.swept_keys` reads as swept from the sweep's record, never parsed by
    Hydra's grammar: every key Hydra's grammar reads as a sweep is among them (else two jobs would share a folder),
    and a key left out is one Hydra reads as one value too."""
    from src.launch.naming import swept_keys

    named = swept_keys([f"key={text}"]) == ["key"]
    try:
        hydra = PARSER.parse_override(f"key={text}")
        sweeps = hydra.is_sweep_override()
    except Exception:  # a text Hydra refuses (or glob() without a config) is never run as typed; naming still holds
        return
    assert named or not sweeps, text
