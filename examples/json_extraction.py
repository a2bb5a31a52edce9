"""JSON extraction with a schema: the server constrains generation so the answer always parses.

Needs a server with constrained decoding; otherwise the server's refusal is printed.

    python examples/json_extraction.py
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from radixserve.lang import Backend, BackendError, RuntimeEndpoint, assistant, function, gen, system, user

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "city": {"type": "string"},
        "age": {"type": "integer"},
    },
    "required": ["name", "city", "age"],
    "additionalProperties": False,
}


@function
def extract_person(s, text: str) -> None:
    s += system("Extract facts as JSON.")
    s += user(f"Text: {text}\nReturn the person's name, city and age.")
    s += assistant(gen("person", json_schema=SCHEMA, max_tokens=64))


def main(backend: Backend) -> list[dict[str, Any]] | None:
    texts = ["Lena Fischer, 34, moved to Hamburg last year.", "At 19, Kwame left Accra to study."]
    try:
        states = extract_person.run_batch([{"text": t} for t in texts], backend=backend, temperature=0)
    except BackendError as exc:
        print(f"the server refused: {exc}")
        return None
    people = [json.loads(state["person"]) for state in states]
    for text, person in zip(texts, people):
        print(f"{text}\n  -> {person}")
    return people


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000", help="a running radixserve server")
    main(RuntimeEndpoint(parser.parse_args().url))
