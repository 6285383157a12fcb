def scatter_copy(
    dst_base: int,
    src_base: int,
    dst_offsets: object,
    src_offsets: object,
    nbytes: object,
    cursor: object = ...,
) -> bool | None: ...
