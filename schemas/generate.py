"""Writes the JSON Schema files of the contracts into schemas/jsonschema/.

Run `python -m schemas.generate` (or `make schemas`) after changing a model; a test fails
when the committed files drift from the models.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel

from schemas.job_payload import JobPayload
from schemas.request import RolloutRequest

SCHEMA_DIR = Path(__file__).parent / "jsonschema"
MODELS: dict[str, type[BaseModel]] = {
    "rollout_request.schema.json": RolloutRequest,
    "job_payload.schema.json": JobPayload,
}


def render(model: type[BaseModel]) -> str:
    schema = model.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def main() -> None:
    SCHEMA_DIR.mkdir(exist_ok=True)
    for name, model in MODELS.items():
        (SCHEMA_DIR / name).write_text(render(model))
        print(f"wrote {SCHEMA_DIR / name}")


if __name__ == "__main__":
    main()
