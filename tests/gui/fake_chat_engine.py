"""A stand-in for ``slideformer chat --json`` that replays a scripted reply (GUI tests only).

    python fake_chat_engine.py MODEL [--log FILE] [--delay S] [--mode M] [--fail MSG]
                                     [--crash-after N] [--words N]

It speaks the protocol of slideformer/engine/generate/protocol.py: ``ready``, then per request one ``token``
event per word of "MODEL-NAME says: <the last user message> <filler words>", then ``done``.
``--log`` appends every request received as a JSON line; ``--fail`` reports a fatal load error;
``--crash-after N`` exits abruptly after N tokens of the first reply.
"""
import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path


def emit(**event):
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--log")
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--mode", default="resident")
    p.add_argument("--fail")
    p.add_argument("--crash-after", type=int)
    p.add_argument("--words", type=int, default=3)
    a = p.parse_args()
    if a.fail:
        emit(event="error", fatal=True, message=a.fail)
        return 2
    emit(event="ready", model=a.model, family="llama", layers=4, params=1000, mode=a.mode,
         device="cpu", dtype="float32", chat_template=True, max_tokens=2048)
    stopped, requests = set(), []
    cond = threading.Condition()

    def read():
        for line in sys.stdin:
            req = json.loads(line)
            if a.log:
                with open(a.log, "a") as f:
                    f.write(json.dumps(req) + "\n")
            with cond:
                if req["op"] == "stop":
                    stopped.add(req["id"])
                else:
                    requests.append(req)
                cond.notify()
        with cond:
            requests.append({"op": "quit"})
            cond.notify()

    threading.Thread(target=read, daemon=True).start()
    sent = 0
    while True:
        with cond:
            cond.wait_for(lambda: requests)
            req = requests.pop(0)
        if req["op"] == "quit":
            return 0
        rid = req["id"]
        words = [f"{Path(a.model).name} says:", req["messages"][-1]["content"]]
        words += [f"w{i}" for i in range(a.words)]
        n, reason = 0, "eos"
        for w in words:
            if rid in stopped:
                reason = "stopped"
                break
            emit(event="token", id=rid, text=(" " if n else "") + w)
            n += 1
            sent += 1
            if a.crash_after is not None and sent >= a.crash_after:
                os._exit(9)
            time.sleep(a.delay)
        emit(event="done", id=rid, reason=reason, prompt_tokens=10, new_tokens=n,
             prefill_s=0.01, decode_s=0.1, tokens_per_s=12.5)


if __name__ == "__main__":
    sys.exit(main())
