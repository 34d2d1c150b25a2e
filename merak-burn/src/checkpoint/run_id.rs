//! The id of a run's lineage: made when a run starts fresh, carried by every checkpoint it
//! writes and by every run that resumes one of them.

use std::fmt;
use std::hash::{BuildHasher, Hash, Hasher};

use serde::{Deserialize, Serialize};

/// A run's lineage id: 16 lowercase hex digits, random.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct RunId(String);

impl RunId {
    /// A new random id (the process's random hash keys mixed with the time and process id).
    pub fn new() -> Self {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default()
            .hash(&mut h);
        std::process::id().hash(&mut h);
        Self(format!("{:016x}", h.finish()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for RunId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for RunId {
    type Error = String;

    /// Accepts 1 to 64 characters of `[0-9a-z_-]` (ids are read from untrusted files).
    fn try_from(s: String) -> Result<Self, String> {
        let ok = (1..=64).contains(&s.len())
            && s.bytes()
                .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase() || b == b'-' || b == b'_');
        if ok {
            Ok(Self(s))
        } else {
            Err(format!(
                "run id {s:?}: expected 1 to 64 characters of 0-9, a-z, '-' and '_'"
            ))
        }
    }
}

impl From<RunId> for String {
    fn from(id: RunId) -> String {
        id.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_random_hex_and_hostile_ones_are_refused() {
        let (a, b) = (RunId::new(), RunId::new());
        assert_ne!(a, b);
        assert_eq!(a.as_str().len(), 16);
        assert_eq!(RunId::try_from(a.to_string()), Ok(a));
        for bad in ["", "../x", "A", &"a".repeat(65), "a b"] {
            assert!(RunId::try_from(bad.to_string()).is_err(), "{bad:?}");
        }
    }
}
