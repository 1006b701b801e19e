"""The request sets (written for this repo): ``copy`` (edit structured records: the answer
repeats most of the prompt, high n-gram agreement), ``rare_terms`` (descriptions full of
unusual terminology: low agreement) and ``long`` (1,024 new tokens, EOS ignored).

Prompt lengths differ within each set; each request's budget is fixed by its set, and
``copy`` / ``rare_terms`` stop at EOS too, so requests in a batch stop at different steps.
"""
from __future__ import annotations

import json

from .config import Request

_RECORDS = [
    {"id": 1042, "name": "Ada Lovelace", "role": "analyst", "active": True,
     "languages": ["English", "French"], "city": "London"},
    {"id": 2207, "name": "Grace Hopper", "role": "admiral", "active": False,
     "languages": ["English"], "city": "Arlington", "team": "compilers"},
    {"sku": "KB-4471", "title": "Mechanical keyboard", "price": 89.5, "stock": 14,
     "tags": ["usb", "backlit"]},
    {"order": 55120, "customer": "Lin Wei", "items": [{"sku": "MS-12", "qty": 2},
                                                       {"sku": "KB-4471", "qty": 1}],
     "status": "shipped"},
    {"host": "db-primary", "port": 5432, "replicas": 2, "backup": {"hour": 3, "keep": 7}},
    {"station": "Oslo-Blindern", "temperature_c": -4.5, "humidity": 81, "wind_kmh": 12},
    {"book": "The Hobbit", "author": "J. R. R. Tolkien", "year": 1937, "pages": 310},
    {"user": "mkovacs", "email": "m.kovacs@example.org", "plan": "pro", "seats": 5,
     "renews": "2027-03-01"},
]

_EDITS = [
    "Rewrite this JSON record as YAML. Output only the YAML.",
    "Return the same JSON with one change: set every boolean to its opposite. Output only "
    "the JSON.",
    "Rewrite this JSON with all keys in UPPER_CASE, values unchanged. Output only the JSON.",
    "Add a field \"checked\": true at the end of this JSON record and output the whole "
    "record.",
]


def _copy_prompts() -> list[str]:
    prompts = []
    for i, record in enumerate(_RECORDS):
        for j in range(2):
            edit = _EDITS[(i + j) % len(_EDITS)]
            text = json.dumps(record, indent=2 if j else None)
            prompts.append(f"{edit}\n\n{text}")
    return prompts


_RARE = [
    "Explain in two sentences what a syzygy is in astronomy and why perihelion matters.",
    "Describe the chemistry of a zwitterion and its isoelectric point.",
    "What is apophenia, and how does it differ from pareidolia?",
    "Explain otoacoustic emissions and the cochlear amplifier briefly.",
    "Describe pyroclastic surges, lahars and phreatomagmatic eruptions.",
    "What do the terms anacrusis, hemiola and melisma mean in music?",
    "Explain karst topography: dolines, poljes and uvalas.",
    "What is a chiral auxiliary in asymmetric synthesis?",
    "Describe the ecology of mycorrhizal networks and saprotrophic fungi.",
    "Explain what heteroskedasticity means in econometrics and how to detect it.",
    "What is the difference between a palimpsest and a codex?",
    "Describe the Mössbauer effect and recoil-free gamma emission.",
    "What are ommatidia, rhabdoms and the compound eye of arthropods?",
    "Explain what an ouroboros is and its use in alchemical iconography.",
    "Describe tessellations by quasicrystals and Penrose tilings.",
    "What are the duties of a sommelier, and what are tannins and terroir?",
]

_LONG = [
    "Write a long, detailed story about a lighthouse keeper who finds a map in a bottle.",
    "Write a detailed guide to planting and caring for a vegetable garden, season by season.",
    "Explain, step by step and at length, how a computer boots from power-on to the desktop.",
    "Write a long travel diary of a week-long train journey across a mountain country.",
    "Write an extended history of the bicycle, from the earliest designs to today.",
    "Describe in detail how to organise a small community library, with every step.",
    "Write a long letter from a ship's captain to her daughter about a voyage.",
    "Explain at length how bread is made, from wheat in the field to the loaf.",
    "Write a detailed tutorial on writing a simple web server in Python, with code.",
    "Write a long fairy tale about a fox, a crow and a river that forgot its name.",
    "Describe, in detail, a day in the life of a medieval blacksmith.",
    "Write a long essay on why people enjoy music, with many examples.",
    "Write an extended guide to learning to play chess, from the rules to tactics.",
    "Describe the water cycle at length, for a curious ten-year-old.",
    "Write a long mystery story set in a snowed-in mountain hotel.",
    "Explain in detail how a city's public transport network is planned.",
]

TASKS = {
    "copy": {"prompts": _copy_prompts(), "max_new_tokens": 160, "stop_at_eos": True},
    "rare_terms": {"prompts": _RARE, "max_new_tokens": 96, "stop_at_eos": True},
    "long": {"prompts": _LONG, "max_new_tokens": 1024, "stop_at_eos": False},
}


def task_requests(tokenizer, task: str, count: int = None, *, max_new_tokens: int = None,
                  seed: int = 0):
    """The task's requests (prompt ids through the tokenizer's chat template)."""
    if task not in TASKS:
        raise ValueError(f"task: expected one of {sorted(TASKS)}, got {task!r}")
    entry = TASKS[task]
    prompts = entry["prompts"][:count] if count else entry["prompts"]
    budget = max_new_tokens or entry["max_new_tokens"]
    return [Request(encode(tokenizer, text), budget, seed=seed + i,
                    stop_at_eos=entry["stop_at_eos"]) for i, text in enumerate(prompts)]


def encode(tokenizer, text: str) -> list[int]:
    """A user turn through the chat template (plain encoding for tokenizers without one)."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, return_dict=True)
        return list(out["input_ids"])
    return list(tokenizer(text)["input_ids"])
