"""Each config section is declared once, in the schema (fsdpzero/config): the plan's type for it is derived from
the schema model, and the docs that list its keys print them from the schema."""
import dataclasses
from pathlib import Path

from fsdpzero.cli.migrate import section_keys_markdown, with_section_keys
from fsdpzero.config import load_config
from fsdpzero.config.sections import Aio
from fsdpzero.plan import Env
from fsdpzero.plan.translate import translate
from fsdpzero.plan.types import AioPlan

DOCS = Path(__file__).resolve().parents[2] / "docs"
# every aio key away from DeepSpeed's default (use_gds=true is refused, so it stays false)
AIO = {"block_size": 2 * 1_048_576, "queue_depth": 3, "intra_op_parallelism": 2, "single_submit": True,
       "overlap_events": False, "use_gds": False}


def test_the_aio_plan_is_the_schema_section():
    declared = {key: (f.annotation, f.default) for key, f in Aio.model_fields.items()}
    planned = {f.name: (f.type, f.default) for f in dataclasses.fields(AioPlan)}
    assert planned == declared
    assert set(AIO) == set(declared), "AIO above no longer sets every aio key"


def test_translate_carries_every_aio_key_into_the_plan():
    cfg = {"train_batch_size": 8, "aio": AIO,
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}}
    assert dataclasses.asdict(translate(load_config(cfg), Env()).offload.aio) == AIO


def test_docs_print_the_aio_keys_from_the_schema():
    doc = (DOCS / "nvme.md").read_text()
    keys = section_keys_markdown("aio")
    assert [line.split("`")[1] for line in keys.splitlines()] == list(Aio.model_fields)
    assert keys in doc, "docs/nvme.md's aio keys differ from the schema: python -m fsdpzero.cli.migrate --write-docs"
    assert with_section_keys(doc) == doc
