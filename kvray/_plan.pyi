"""The planner's C loops (kvray/_plan.c); each array is C-contiguous native int64."""

def check_ids(blocks: object, out: object, num_blocks: int) -> bool: ...
def check_id_array(ids: object, num_blocks: int) -> bool: ...
def sort_blocks(
    local_ids: object,
    remote_ids: object,
    local_pool: int,
    remote_pool: int,
    out_local: object,
    out_remote: object,
) -> tuple[int, int] | None: ...
def expand_ops(
    local_region: object,
    local_base: object,
    local_stride: object,
    remote_region: object,
    remote_base: object,
    remote_stride: object,
    row_nbytes: object,
    local_ids: object,
    remote_ids: object,
    out_local_region: object,
    out_local_offset: object,
    out_remote_region: object,
    out_remote_offset: object,
    out_nbytes: object,
) -> bool: ...
def merge_ops(
    local_region: object,
    local_offset: object,
    remote_region: object,
    remote_offset: object,
    nbytes: object,
    order: object | None,
    out_local_region: object,
    out_local_offset: object,
    out_remote_region: object,
    out_remote_offset: object,
    out_nbytes: object,
) -> int: ...
def first_outside(region: object, offset: object, nbytes: object, region_lengths: object) -> int: ...
def rows_outside(
    region: object, base: object, stride: object, nbytes: object, low: int, high: int, region_lengths: object
) -> int: ...
def plan_ids(
    local_ids: object,
    remote_ids: object,
    out: object,
    local_pool: int,
    remote_pool: int,
    local_rows: object,
    local_lengths: object,
    remote_rows: object,
    remote_lengths: object,
) -> bool: ...
def placement_digest(
    region: object, start: object, nbytes: object, stride: object | None, blocks: object | None, shift: int
) -> int: ...
def held_digest(
    sums: object,
    held: object,
    parts: int,
    num_blocks: int,
    layer: object,
    part: object,
    salt: object,
    src_start: object,
    src_stride: object,
    dst_start: object,
    dst_stride: object,
    local_ids: object,
    remote_ids: object,
) -> int | None: ...
