"""Slot names and values as the standardized MultiWOZ evaluator normalises them.

The convention is Nekvinda & Dusek 2021, "Shades of BLEU, Flavours of Success: The Case of
MultiWOZ" (github Tomiinek/MultiWOZ_Evaluation, ``mwzeval/normalization.py``), whose scores
fill the table in the budzianowski/multiwoz README. Published systems delexicalise in
different styles; this maps them onto one ontology so one scorer reads them all:

- **Placeholders**: ``[hotel_phone]`` (domain_slot), ``[value_phone]`` (DAMD's
  domain-adaptive style), ``[phone]``, with a plural suffix (``[value_name]s``) or not, all
  become the bare ``PHONE`` in the lowercased response. Upper case then marks exactly the
  placeholders, so the scorer tests ``"NAME" in response``. A placeholder outside the
  ontology becomes nothing (and is counted: :class:`ResponseNormalizer.unknown`).
- **State slot names**: lowercased without spaces (``book day`` -> ``bookday``), with
  ``arriveBy`` -> ``arrive`` and ``leaveAt`` -> ``leave`` as the database columns.
- **State values**: misspelt or shortened venue names and foods to the database's spelling,
  times to ``HH:MM``, ``free`` parking/internet to ``yes``, attraction types to the
  database's spelling.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping

# The unified ontology: each canonical placeholder and the slot names that mean it.
_PLACEHOLDER_ALIASES: dict[str, tuple[str, ...]] = {
    "ADDRESS": (
        "address",
        "value_address",
        "attraction_address",
        "hospital_address",
        "hotel_address",
        "police_address",
        "restaurant_address",
    ),
    "AREA": ("area", "value_area", "attraction_area", "restaurant_area", "hotel_area"),
    "TIME": (
        "time",
        "value_time",
        "booktime",
        "duration",
        "value_duration",
        "train_duration",
        "arriveby",
        "arrive by",
        "value_arrive",
        "taxi_arriveby",
        "train_arriveby",
        "train_arrive",
        "leaveat",
        "leave at",
        "value_leave",
        "train_leaveat",
        "train_leave",
        "taxi_leaveat",
    ),
    "DAY": ("day", "value_day", "bookday", "train_day"),
    "PLACE": (
        "destination",
        "value_destination",
        "departure",
        "value_departure",
        "value_place",
        "train_departure",
        "train_destination",
        "taxi_destination",
        "taxi_departure",
    ),
    "FOOD": ("food", "value_food", "restaurant_food"),
    "NAME": (
        "name",
        "value_name",
        "attraction_name",
        "hospital_name",
        "hotel_name",
        "police_name",
        "restaurant_name",
    ),
    "PHONE": (
        "phone",
        "value_phone",
        "attraction_phone",
        "hospital_phone",
        "hotel_phone",
        "police_phone",
        "restaurant_phone",
        "taxi_phone",
    ),
    "POST": (
        "postcode",
        "value_postcode",
        "attraction_postcode",
        "hospital_postcode",
        "hotel_postcode",
        "restaurant_postcode",
        "police_postcode",
    ),
    "PRICE": (
        "price",
        "value_price",
        "pricerange",
        "price range",
        "value_pricerange",
        "entrancefee",
        "entrance fee",
        "train_price",
        "attraction_entrancefee",
        "attraction_price",
        "restaurant_pricerange",
        "hotel_pricerange",
        "attraction_pricerange",
    ),
    "REFERENCE": (
        "reference",
        "ref",
        "value_reference",
        "attraction_reference",
        "hotel_reference",
        "restaurant_reference",
        "train_reference",
    ),
    "COUNT": (
        "choice",
        "value_choice",
        "value_count",
        "stars",
        "value_stars",
        "hotel_stars",
        "bookstay",
        "stay",
        "value_stay",
        "bookpeople",
        "people",
        "value_people",
        "attraction_choice",
        "hotel_choice",
        "restaurant_choice",
        "train_choice",
    ),
    "TYPE": (
        "type",
        "value_type",
        "car",
        "value_car",
        "taxi_type",
        "taxi_car",
        "restaurant_type",
        "hotel_type",
        "attraction_type",
    ),
    "TRAINID": ("trainid", "train_id", "value_id", "id", "train", "train_trainid"),
    "INTERNET": ("internet", "hotel_internet"),
    "PARKING": ("parking", "hotel_parking"),
    "ID": ("hospital_id", "attraction_id", "restaurant_id"),
    "DEPARTMENT": ("department", "value_department", "hospital_department"),
    "OPEN": ("openhours",),
}
PLACEHOLDER_OF = {alias: canon for canon, names in _PLACEHOLDER_ALIASES.items() for alias in names}

# ``[slot]`` with an optional plural suffix glued on (``[value_name]s``, ``[value_name]-s``)
_PLACEHOLDER_RE = re.compile(r"\[([\w\s]+)\](?:es|s|-s|-es)?")


class ResponseNormalizer:
    """Lowercases responses and rewrites their placeholders to the canonical names."""

    def __init__(self) -> None:
        self.unknown: Counter[str] = Counter()  # placeholders outside the ontology

    def __call__(self, response: str) -> str:
        return _PLACEHOLDER_RE.sub(self._canonical, response.lower())

    def _canonical(self, match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in PLACEHOLDER_OF:
            self.unknown[name] += 1
            return ""
        return PLACEHOLDER_OF[name]


DOMAINS = ("restaurant", "hotel", "attraction", "train", "taxi", "police", "hospital")


def placeholder_domains(response: str) -> list[str]:
    """The domains the ``[domain_slot]`` placeholders of ``response`` name, sorted."""
    named = {m.group(1).lower().split("_")[0] for m in _PLACEHOLDER_RE.finditer(response)}
    return sorted(named & set(DOMAINS))


def slot_name(slot: str) -> str:
    """A state or goal slot name as a database column: ``leaveAt`` -> ``leave``,
    ``book day`` -> ``bookday``, ``entrance fee`` -> ``entrancefee``."""
    slot = slot.lower().replace(" ", "")
    return {"arriveby": "arrive", "leaveat": "leave"}.get(slot, slot)


# Venue names as users and annotators wrote them -> the database's spelling.
_NAME_FIXES: dict[str, str] = {
    # restaurants
    "hotel du vin bistro": "hotel du vin and bistro",
    "the river bar and grill": "the river bar steakhouse and grill",
    "nando's": "nandos",
    "city center b and b": "city center north b and b",
    "acorn house": "acorn guest house",
    "caffee uno": "caffe uno",
    "cafe uno": "caffe uno",
    "rosa's": "rosas bed and breakfast",
    "restaurant called two two": "restaurant two two",
    "restaurant 2 two": "restaurant two two",
    "restaurant two 2": "restaurant two two",
    "restaurant 2 2": "restaurant two two",
    "restaurant 1 7": "restaurant one seven",
    "restaurant 17": "restaurant one seven",
    # hotels
    "lime house": "limehouse",
    "cityrooms": "cityroomz",
    "whale of time": "whale of a time",
    "huntingdon hotel": "huntingdon marriott hotel",
    "holiday inn exlpress, cambridge": "express by holiday inn cambridge",
    "university hotel": "university arms hotel",
    "arbury guesthouse and lodge": "arbury lodge guesthouse",
    "bridge house": "bridge guest house",
    "arbury guesthouse": "arbury lodge guesthouse",
    "nandos in the city centre": "nandos city centre",
    # attractions
    "broughton gallery": "broughton house gallery",
    "scudamores punt co": "scudamores punting co",
    "cambridge botanic gardens": "cambridge university botanic gardens",
    "the junction": "junction theatre",
    "trinity street college": "trinity college",
    "christ college": "christ's college",
    "christs": "christ's college",
    "history of science museum": "whipple museum of the history of science",
    "parkside pools": "parkside swimming pool",
    "the botanical gardens at cambridge university": "cambridge university botanic gardens",
    "cafe jello museum": "cafe jello gallery",
}
_FOOD_FIXES: dict[str, str] = {
    "eriterean": "mediterranean",
    "brazilian": "portuguese",
    "sea food": "seafood",
    "portugese": "portuguese",
    "modern american": "north american",
    "americas": "north american",
    "intalian": "italian",
    "italain": "italian",
    "asian or oriental": "asian",
    "english": "british",
    "australasian": "australian",
    "gastropod": "gastropub",
    "brutish": "british",
    "bristish": "british",
    "europeon": "european",
}
_TYPE_FIXES: dict[str, str] = {
    "swimming pool": "swimmingpool",
    "mutliple sports": "multiple sports",  # the released attraction DB's own typo
    "night club": "nightclub",
    "guest house": "guesthouse",
}
# Spoken times and their clock time, as the standardized evaluator reads them.
_TIME_WORDS: dict[str, str] = {
    "afternoon": "13:00",
    "lunch": "12:00",
    "noon": "12:00",
    "mid-day": "12:00",
    "around lunch time": "12:00",
    "morning": "08:00",
    "seven o'clock tomorrow evening": "07:00",
    "three forty five p.m": "15:45",
    "one thirty p.m.": "13:30",
    "six fourty five": "06:45",
    "eight thirty": "08:30",
}
_TIME_PREFIXES = (("one o'clock p.m", "13:00"), ("ten o'clock a.m", "10:00"))


def _name(value: str) -> str:
    name = value.strip().lower().replace(" & ", " and ").replace("&", " and ")
    name = name.replace(" '", "'")
    return _NAME_FIXES.get(name, name)


def _time(value: str) -> str:
    """A spoken or written time as ``HH:MM`` where it can be read, else as written."""
    time = value.strip().lower()
    if time in _TIME_WORDS:
        return _TIME_WORDS[time]
    for prefix, clock in _TIME_PREFIXES:
        if time.startswith(prefix):
            return clock
    if time.startswith("by"):
        time = time[3:]
    for prefix in ("after", "afer"):
        if time.startswith(prefix):
            time = time[len(prefix) :].strip()
    for suffix in ("am", "a.m."):
        if time.endswith(suffix):
            time = time[: -len(suffix)].strip()
    for suffix in ("pm", "p.m."):
        if time.endswith(suffix):
            time = time[: -len(suffix)].strip()
            parts = time.split(":")
            if len(parts) == 2 and parts[0].isdigit():
                return f"{int(parts[0]) + 12}:{parts[1]}"
            if len(parts) == 1 and parts[0].isdigit():
                return f"{int(parts[0]) + 12}:00"
            break
    if not time:
        return "00:00"
    if time[-1] in ".,?":
        time = time[:-1]
    if time.isdigit():
        return f"{time[:2]}:{time[2:]}" if len(time) == 4 else f"{time.zfill(2)}:00"
    if ":" in time:
        time = time.replace(" ", "")
    if len(time) == 4 and time[1] == ":":
        return f"0{time}"
    return time


def slot_value(slot: str, value: str) -> str:
    """A state/goal value in the database's spelling (``slot`` already :func:`slot_name`)."""
    if slot in ("name", "destination", "departure"):
        return _name(value)
    if slot == "type":
        return _TYPE_FIXES.get(value, value)
    if slot == "food":
        food = value.strip().lower()
        return _FOOD_FIXES.get(food, food)
    if slot in ("arrive", "leave", "time"):
        return _time(value)
    if slot in ("parking", "internet"):
        return "yes" if value == "free" else value
    return value


def state(raw: Mapping[str, Mapping[str, str]]) -> dict[str, dict[str, str]]:
    """A ``{domain: {slot: value}}`` dialogue state with slot names and values normalised."""
    out: dict[str, dict[str, str]] = {}
    for domain, slots in raw.items():
        named = {slot_name(s): v for s, v in slots.items()}
        out[domain] = {s: slot_value(s, v) for s, v in named.items()}
    return out


def minutes(clock: str) -> int:
    """``HH:MM`` as minutes after midnight; 0 for anything else (as the evaluator)."""
    if not re.match(r"[0-9][0-9]:[0-9][0-9]", clock):
        return 0
    return int(clock[:2]) * 60 + int(clock[3:5])
