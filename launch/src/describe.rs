//! How `merak` words an error for the user: the error and its causes on one line, each cause
//! once.

/// `e` and its chain of causes joined with `: `, leaving out a cause whose text the line
/// already holds (library errors that name their cause in their own message also expose it
/// as their source, which `{:#}` would print twice: `no such folder: no such folder`).
pub fn describe(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("reading {path}: {source}")]
    struct Named {
        path: String,
        source: std::io::Error,
    }

    #[test]
    fn each_cause_is_said_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such folder");
        let e = anyhow::Error::new(Named {
            path: "/x".into(),
            source: io,
        })
        .context("resuming");
        assert_eq!(
            format!("{e:#}"),
            "resuming: reading /x: no such folder: no such folder"
        );
        assert_eq!(describe(&e), "resuming: reading /x: no such folder");
        // A cause the message does not name is kept.
        let e = anyhow::anyhow!("disk full").context("writing the checkpoint");
        assert_eq!(describe(&e), "writing the checkpoint: disk full");
    }
}
