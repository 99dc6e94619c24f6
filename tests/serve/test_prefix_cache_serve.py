"""`snapspec serve --cache-ram`: two conversations taking turns on one server each resume from the prefix cache
(their slot's context held the other one), the replies equal fresh in-process generations, the official `openai`
client reads usage.prompt_tokens_details.cached_tokens (plain and streamed), /metrics counts the cache, and a bad
size is a one-line error. Loopback only; every wait bounded."""

from __future__ import annotations

import pytest

from serving import metrics, openai_client, serving

FLAGS = ("--threads", "1", "--draft-max", "3", "--max-new-tokens", "8", "--drafter", "ngram")
SYSTEM = {"a": "You are a careful assistant who answers in one line. " * 2,
          "b": "Reply as a terse shell expert would, in lower case. " * 2}


@pytest.fixture(scope="module")
def target(chat_export):
    return chat_export("qwen3_5_text", "lfm2")



def test_two_conversations_resume_from_the_cache(target, tmp_path):
    from snapspec.runtime import generate, load
    from snapspec.runtime.prompt import FrontDoor

    model = load(target, threads=1)
    door = FrontDoor(model)
    talks = {name: [{"role": "system", "content": text}] for name, text in SYSTEM.items()}
    with serving(tmp_path / "server.log", target, *FLAGS, "--cache-ram", "64MiB") as server:
        assert "prefix cache 64 MiB" in server["log"].read_text()
        client, bases = openai_client(server), {}
        for turn in range(2):
            for name, messages in talks.items():
                messages.append({"role": "user", "content": f"turn {turn} of {name}"})
                if turn == 1 and name == "b":  # streamed, with the usage chunk
                    events = list(client.chat.completions.create(model=server["model"], messages=messages,
                                                                 stream=True, stream_options={"include_usage": True}))
                    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
                    usage = events[-1].usage
                else:
                    reply = client.chat.completions.create(model=server["model"], messages=messages)
                    text, usage = reply.choices[0].message.content, reply.usage
                assert text == model.decode(generate(model, messages, max_new_tokens=8).tokens)
                cached = usage.prompt_tokens_details.cached_tokens
                if turn == 0:
                    assert cached == 0
                else:  # the other conversation ran in between: this one came back from the cache
                    assert cached >= bases[name], (name, cached, bases[name])
                bases[name] = door.chat(messages).base
                messages.append({"role": "assistant", "content": text})
        m = metrics(server)
        assert m["snapspec_prefix_cache_hits_total"] >= 2
        assert m["snapspec_prefix_cache_tokens_reused_total"] >= sum(bases.values()) // 2
        assert 0 < m["snapspec_prefix_cache_bytes"] <= m["snapspec_prefix_cache_budget_bytes"] == 64 << 20
        assert "snapspec_prefix_cache_evictions_total" in m
        assert "from the prefix cache" in server["log"].read_text()


def test_cache_off_still_reports_what_the_context_held(target, tmp_path):
    messages = [{"role": "system", "content": SYSTEM["a"]}, {"role": "user", "content": "hello"}]
    with serving(tmp_path / "server.log", target, *FLAGS, "--cache-ram", "0") as server:
        assert "no prefix cache" in server["log"].read_text()
        client = openai_client(server)
        first = client.chat.completions.create(model=server["model"], messages=messages)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "again"}]
        second = client.chat.completions.create(model=server["model"], messages=messages)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens > len(SYSTEM["a"])  # the slot's context held it
        assert not any(k.startswith("snapspec_prefix_cache") for k in metrics(server))


@pytest.mark.parametrize("size, expected", [("0", 0), ("512", 512), ("2GiB", 2 << 30), ("1.5 GB", 1_500_000_000),
                                            ("64m", 64 << 20), ("3KiB", 3072)])
def test_cache_ram_sizes(size, expected):
    from snapspec.cli.main import build_parser

    assert build_parser().parse_args(["serve", "--target", "T", "--cache-ram", size]).cache_ram == expected


@pytest.mark.parametrize("size", ["2 gigs", "-1", "GiB", "1e400", "nan", "12XB"])
def test_cache_ram_errors_are_one_line(size, capsys):
    from snapspec.cli.main import main

    assert main(["serve", "--target", "T", "--cache-ram", size]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--cache-ram" in err and "is not a size" in err, err
