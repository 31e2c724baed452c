"""jaxvmm quickstart: a fixed-address slot whose physical memory is given back and mapped again."""
import sys

import numpy as np

import jaxvmm

MiB = 1 << 20


def check(ok: bool, what: str) -> None:
    if not ok:
        sys.exit(f"FAILED: {what}")


def memory() -> tuple[int, int]:
    """(driver free bytes, bytes jaxvmm has mapped): the kernel's MemAvailable is noisy on cpu, the second is not."""
    return jaxvmm.driver_memory_info()[0], jaxvmm.stats()["mapped_bytes"]


def show(step: str, before, after) -> None:
    print(f"{step:8s} driver free {before[0] // MiB} -> {after[0] // MiB} MiB ({(after[0] - before[0]) / MiB:+.1f}), "
          f"jaxvmm mapped {before[1] // MiB} -> {after[1] // MiB} MiB")


slot = jaxvmm.Slot(256 * MiB)  # device=None: jax's default device (cuda:0 on a GPU machine, else cpu:0)
print(f"{slot.device} ({slot.backend}): address=0x{slot.address:x} size={slot.size // MiB} MiB "
      f"generation={slot.generation}")

pattern = np.arange(slot.nbytes // 4, dtype=np.uint32)  # 256 MiB of known bytes
slot.write(pattern)
check(np.array_equal(slot.read().view(np.uint32), pattern), "read-back differs from what was written")
address, generation = slot.address, slot.generation

m0 = memory()
slot.release()  # physical pages go back to the driver; the address stays reserved
m1 = memory()
show("release:", m0, m1)
slot.remap()  # fresh pages at the same address (contents undefined), generation + 1
m2 = memory()
show("remap:", m1, m2)

check(m0[1] - m1[1] == slot.size and m2[1] == m0[1], "release/remap did not unmap/map the whole slot")
check(slot.address == address, f"address moved: 0x{address:x} -> 0x{slot.address:x}")
check(slot.generation > generation, f"generation did not go up ({generation} -> {slot.generation})")
slot.close()
check(jaxvmm.stats()["mapped_bytes"] == 0, "close left pages mapped")
print(f"memory came back: released {(m0[1] - m1[1]) // MiB} MiB, address stable across remap (0x{address:x})")
