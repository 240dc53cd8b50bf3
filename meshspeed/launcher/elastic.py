"""`--nnodes MIN:MAX`: torchrun's elastic form, made to work as the docs write it. Pure.

    meshspeed run --nnodes 1:2 --nproc-per-node 2 --master_addr node0 train.py    (on each node)

torchrun's default rendezvous (static) needs all MAX nodes, so this form waited forever
without a message. Here MIN < MAX turns --master_addr/--master_port into the c10d
rendezvous at that address (`--rdzv-backend c10d --rdzv-endpoint A:P --rdzv-id ...`),
and `meshspeed run`'s rendezvous wrapper keeps torch 2.13's agents from deadlocking when
a host joins (Note [the bootstrap store of a joining host] in rounds.py). DeepSpeed's
--min_elastic_nodes / --max_elastic_nodes mean --nnodes MIN:MAX.
"""

from __future__ import annotations

from meshspeed.launcher.ds_launcher import DEFAULT_PORT, LaunchError

DEFAULT_RDZV_ID = "meshspeed"  # the same on every node started by hand (torchrun's is "none")


def take_option(tokens: list[str], names: tuple[str, ...]) -> tuple[str | None, list[str]]:
    """(the last value given for any of `names`, the tokens without them): handles both
    `--name value` and `--name=value`."""
    value, out, i = None, [], 0
    while i < len(tokens):
        word = tokens[i]
        name, eq, inline = word.partition("=")
        if name in names:
            if eq:
                value, i = inline, i + 1
                continue
            if i + 1 >= len(tokens):
                raise LaunchError(f"{word} needs a value")
            value, i = tokens[i + 1], i + 2
            continue
        out.append(word)
        i += 1
    return value, out


def nnodes_range(spec: str | None) -> tuple[int, int] | None:
    """"1:2" -> (1, 2); "2" -> (2, 2); None -> None. Refuses what torchrun would misread."""
    if spec is None:
        return None
    low, colon, high = spec.partition(":")
    try:
        out = (int(low), int(high if colon else low))
    except ValueError:
        raise LaunchError(f"--nnodes {spec}: write a number of nodes (2) or a range MIN:MAX (1:2)") from None
    if not 1 <= out[0] <= out[1]:
        raise LaunchError(f"--nnodes {spec}: need 1 <= MIN <= MAX")
    return out


def deepspeed_range(min_nodes: int | None, max_nodes: int | None, hosts: int | None) -> str | None:
    """DeepSpeed's --min_elastic_nodes/--max_elastic_nodes as an --nnodes spec (None: not given)."""
    if min_nodes is None and max_nodes is None:
        return None
    high = max_nodes if max_nodes is not None else hosts
    if high is None:
        raise LaunchError("--min_elastic_nodes without a hostfile needs --max_elastic_nodes too")
    return f"{min_nodes if min_nodes is not None else 1}:{high}"


def is_elastic(tokens: list[str]) -> bool:
    """Whether `tokens` ask for --nnodes MIN:MAX with MIN < MAX."""
    span = nnodes_range(take_option(tokens, ("--nnodes",))[0])
    return span is not None and span[0] != span[1]


def local_form(tokens: list[str], master_addr: str | None, master_port: int | None) -> list[str]:
    """This node's torchrun options for `--nnodes MIN:MAX` (in `tokens`). Tokens without an
    elastic --nnodes, or with a rendezvous the user chose, come back unchanged."""
    spec, _ = take_option(tokens, ("--nnodes",))
    span = nnodes_range(spec)
    if not is_elastic(tokens):
        return tokens
    backend, _ = take_option(tokens, ("--rdzv-backend", "--rdzv_backend"))
    if backend not in (None, "static") or "--standalone" in tokens:
        return tokens
    if backend == "static":
        raise LaunchError(f"--nnodes {spec} cannot work with --rdzv-backend static, which waits for all "
                          f"{span[1]} nodes; leave --rdzv-backend out (meshspeed then uses c10d)")
    if master_addr is None:
        raise LaunchError(f"--nnodes {spec} needs where the nodes meet: --master_addr <node 0's address> "
                          "(the same on every node), or --rdzv-backend c10d --rdzv-endpoint HOST:PORT")
    rdzv_id, _ = take_option(tokens, ("--rdzv-id", "--rdzv_id"))
    out = [*tokens, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master_addr}:{master_port or DEFAULT_PORT}"]
    out += [] if rdzv_id is not None else ["--rdzv-id", DEFAULT_RDZV_ID]
    return out
