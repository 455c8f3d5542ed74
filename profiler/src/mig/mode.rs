//! A GPU's MIG mode: on or off now, and after the next GPU reset.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
/// MIG mode as NVML reports it (`nvmlDeviceGetMigMode`).
pub struct MigMode {
    pub current: bool,
    /// The mode after the next GPU reset.
    pub pending: bool,
}

/// "on" or "off", as a mode reads in messages.
pub(crate) fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}
