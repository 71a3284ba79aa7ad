//! The paged KV cache: what a block is, where its bytes live, who owns it.
//!
//! - [`spec`]: KV cache groups and per-layer specs (full attention, sliding window).
//! - [`layout`]: the physical layout of one layer's K and V caches, and byte views of one block.
//! - [`storage`]: the memory that holds every layer's K and V, owned by a worker.
//! - [`device`]: a cache in an accelerator's memory, as a storage reaches it.
//! - [`block_pool`]: ref-counted blocks, an O(1) LRU free list and the prefix-cache index.
//! - [`block_hash`]: the hash chain that names a full block by its tokens.
//! - [`manager`]: per-request block tables on top of the pool, prefix-cache lookups.
//!
//! Invariant shared by all modules: a block id is an index into every layer's cache of a group;
//! the block pool is the only owner of which request may write a block.

pub mod block_hash;
pub mod block_pool;
pub mod device;
pub mod dtype;
pub mod error;
pub mod layout;
pub mod manager;
pub mod spec;
pub mod storage;

pub use block_hash::BlockHash;
pub use block_pool::{BlockId, BlockPool};
pub use device::{Allocation, DeviceKvMemory, MemoryKind};
pub use dtype::CacheDtype;
pub use error::KvCacheError;
pub use layout::{BlockLayout, LayerKv, LayoutOrder};
pub use manager::{
    group_table, CachedPrefix, GroupPoolConfig, KvCacheManager, PrefixCacheStats, NULL_BLOCK,
};
pub use spec::{KvCacheConfig, KvCacheGroup, KvCacheSpec};
pub use storage::{KvPart, KvStorage, MemoryRegion};
