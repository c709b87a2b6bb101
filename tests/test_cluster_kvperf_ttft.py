"""kvperf ``--rw=ttft`` over an etcd cluster: the prefix KV stored on 2 of 3 members and
loaded back bit-exact; the report carries the client's cluster figures."""
import json

import pytest

from cluster_fixtures import etcd, start_member  # noqa: F401
from kvtier.client import BlockClient
from kvtier.tools.kvperf.cli import EXIT_OK, run


def test_ttft_on_an_etcd_target(etcd, tmp_path, capsys):  # noqa: F811
    pytest.importorskip("transformers")
    daemons = [start_member(tmp_path, etcd, f"node-{n}") for n in "abc"]
    try:
        code = run(["--output-format=json", f"--target={etcd.url()}", "--name=t", "--rw=ttft",
                    "--model=random-llama-tiny", "--prompt_tokens=72", "--cached_tokens=64", "--block_tokens=16",
                    "--concurrency=1", "--ttft_prompts=2", "--verify=1"])
        out = capsys.readouterr()
        assert code == EXIT_OK, out.err
        (job,) = json.loads(out.out)["jobs"]
        t = job["ttft"]
        assert job["verify_errors"] == 0 and t["logits_max_abs_diff"] == 0.0 and t["cached_tokens"] == 64
        assert t["kvtier_ms"]["N"] >= 2 and t["warm_tier"]["hits"] > 0
        assert t["cluster"]["members"]["members"] == 3 and t["cluster"]["connections_open"] == 3
        blocks = []
        for d in daemons:
            with BlockClient(d.data_addr) as c:
                blocks.append(c.stats()["engine"]["blocks"])
        assert sum(blocks) % 2 == 0 and sum(blocks) > 0  # each stored object on two owners
    finally:
        for d in daemons:
            assert d.stop() == 0, d.log_tail()
