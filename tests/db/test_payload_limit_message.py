"""One payload limit, one message (issue 27, item 7): a file too large to read and an input too
large to store are refused in the same words, naming the limit."""

from __future__ import annotations

import json
import re

from cli_support import run_cli

import cyclone
from cyclone.db import MAX_PAYLOAD_BYTES
from cyclone.testing import TestEnv

sink = cyclone.Workflow("payload-sink")


@sink.task()
def keep(ctx):
    return None


LIMIT = re.compile(r"of JSON, over the payload limit of 1 MiB \(1048576 bytes\)")


def test_a_large_input_and_a_huge_file_say_the_same(env: TestEnv, capsys, tmp_path) -> None:
    env.client.submit(sink)  # registers it
    big = tmp_path / "big.json"
    big.write_text(json.dumps("x" * (MAX_PAYLOAD_BYTES + 10)))
    stored = run_cli(capsys, env, "submit", "payload-sink", "--input", f"@{big}")
    assert stored.code == 2
    assert LIMIT.search(stored.err), stored.err
    assert f"{MAX_PAYLOAD_BYTES + 12} bytes of JSON" in stored.err

    huge = tmp_path / "huge.json"
    huge.write_bytes(b" " * (16 * MAX_PAYLOAD_BYTES + 1))  # not read whole: refused as read
    read = run_cli(capsys, env, "submit", "payload-sink", "--input", f"@{huge}")
    assert read.code == 2
    assert LIMIT.search(read.err), read.err
    assert "more than 16777216 bytes of JSON" in read.err
