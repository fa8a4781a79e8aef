"""Talk to a running kvrelay app from a separate Ray driver through its Python handle.

    python -m app.handle_example --address 127.0.0.1:6379 [--app kvrelay] [--stream]

The handle API takes the same requests as the HTTP endpoint (vLLM's request models, or plain dicts) and returns
vLLM's response models with a `kvrelay` field saying how the turn was planned.
"""

from __future__ import annotations

import argparse
import asyncio
import os


async def main_async(args: argparse.Namespace) -> None:
    from ray import serve

    handle = serve.get_app_handle(args.app)
    # The body the HTTP endpoint takes, as a dict: a driver that only streams needs no vLLM installed.
    request = {"model": args.model, "messages": [{"role": "user", "content": args.question}],
               "max_tokens": args.max_tokens, "temperature": 0, "stream": args.stream}
    if args.stream:
        async for chunk in handle.options(stream=True).chat.remote(request):
            for choice in chunk["choices"]:
                print(choice["delta"].get("content") or "", end="", flush=True)
            if "kvrelay" in chunk:
                print(f"\n[plan] {chunk['kvrelay']}")
        return
    response = await handle.chat.remote(request)  # vLLM's ChatCompletionResponse, with a `kvrelay` field
    print(response.choices[0].message.content)
    print(f"[usage] {response.usage.model_dump()}")
    print(f"[plan] {response.kvrelay.model_dump()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="the Ray cluster's GCS address (host:port)")
    parser.add_argument("--app", default="kvrelay")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--question", default="What is the capital of France?")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    ray.init(address=args.address, namespace="serve", logging_level="WARNING")
    try:
        asyncio.run(main_async(args))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
