"""A user-defined actor called across two processes. Run: .venv/bin/python examples/hello_actor.py"""

import asyncio
import os

from digenrl.actors import Actor, ActorSystem, endpoint


class Greeter(Actor):
    async def setup(self) -> None:  # heavy init; its errors reach the spawner
        self.greeted = 0

    @endpoint
    async def greet(self, name: str) -> str:
        self.greeted += 1
        return f"hello {name} #{self.greeted} from pid {os.getpid()}"


async def main() -> None:
    async with ActorSystem() as system:  # owns processes, sockets and supervision
        greeter = await system.spawn(Greeter, name="greeter", process=True)
        print(await greeter.greet.call("world"), f"(driver pid {os.getpid()})")
        print(await greeter.greet.call("again"))


# The actor's process loads this file again (as __digenrl_main__) to find Greeter; the guard keeps it from
# running main() too.
if __name__ == "__main__":
    asyncio.run(main())
