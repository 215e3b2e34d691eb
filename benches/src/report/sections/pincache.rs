//! Report sections of `pincache` programs (to be written).

use serde_json::Value;

use crate::report::figure::{BuildError, Section};

/// Sections of the `pin_cost` document.
pub fn pin_cost(doc: &Value) -> Result<Vec<Section>, BuildError> {
    let _ = doc;
    Ok(Vec::new())
}

/// Sections of the `pin_hitrate` document.
pub fn pin_hitrate(doc: &Value) -> Result<Vec<Section>, BuildError> {
    let _ = doc;
    Ok(Vec::new())
}

/// Sections of the `register_cost` document.
pub fn register_cost(doc: &Value) -> Result<Vec<Section>, BuildError> {
    let _ = doc;
    Ok(Vec::new())
}

/// Sections of the `barrier_wait` document.
pub fn barrier_wait(doc: &Value) -> Result<Vec<Section>, BuildError> {
    let _ = doc;
    Ok(Vec::new())
}
