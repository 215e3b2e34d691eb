//! GASNet-style active messages (placeholder: the descriptor cache only;
//! the `gasnet` branch owns this file).

pub mod descriptor_cache;
