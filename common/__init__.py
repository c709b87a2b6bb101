"""What the client and the daemon share: block keys and namespaces, the block format,
the stripe geometry. Depends on nothing beyond the standard library, numpy and crc32c."""
