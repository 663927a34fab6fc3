"""Reading back an offline W&B run (``WANDB_MODE=offline``): its ``run-ID.wandb`` file, as ``wandb sync`` reads it.

wandb 0.31 writes the file from its Go core and ships no Python reader. The format is W&B's header (``:W&B``,
magic 0xBEE1, version 0) then LevelDB's log format (32 KiB blocks of records, each a 7-byte header: CRC32C, length,
type FULL/FIRST/MIDDLE/LAST) carrying ``wandb.proto.wandb_internal_pb2.Record`` messages.
"""
import json
import struct
from pathlib import Path

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    """Every ``Record`` of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    out, pos, pending = [], HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += left
            continue
        assert kind in (FULL, FIRST, MIDDLE, LAST), kind
        pending += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def offline_run(wandb_dir: Path) -> dict:
    """The one offline run under ``wandb_dir``: {"id", "name", "project", "config", "history", "tables"}: history
    is the list of logged scalar dicts (values decoded from JSON; W&B's own ``_step``, ``_runtime``, ``_timestamp``
    dropped), tables maps each logged table's key to the list of its logged versions, each a list of rows as dicts."""
    [path] = sorted(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb"))
    run, history, tables = None, [], {}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run = r.run
        elif kind == "history":
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
            for key in {k.rsplit("/", 1)[0] for k, v in row.items() if k.endswith("/_type") and v == "table-file"}:
                table = json.loads((path.parent / "files" / row[f"{key}/path"]).read_text())
                tables.setdefault(key, []).append([dict(zip(table["columns"], d)) for d in table["data"]])
                row = {k: v for k, v in row.items() if not k.startswith(key + "/")}
            row = {k: v for k, v in row.items() if not k.startswith("_")}
            if set(row) - {"train/global_step"}:  # a row that held only tables is in tables
                history.append(row)
    config = {u.key: json.loads(u.value_json) for u in run.config.update if u.key != "_wandb"}
    return {"id": run.run_id, "name": run.display_name, "project": run.project, "config": config,
            "history": history, "tables": tables}
