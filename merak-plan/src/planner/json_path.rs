//! Where in a JSON file a `serde_json` data error is: the dotted path of the value at the
//! error's line and column (`plan.layout.dp`, `plan.layout.recompute[1]`), so that the
//! planner's files name the field of a value of the wrong type.

/// One level of nesting while scanning: an object (with the key whose value is being read) or
/// an array (with the index of the element being read).
enum Level {
    Object(Option<String>),
    Array(usize),
}

/// `e` with the dotted path of the value it is about in front (`plan.layout.dp: invalid type:
/// string "two", expected usize at line 3 column 12`) when it is a data error (a value of the
/// wrong type or out of range, an unknown or missing field) inside an object; otherwise its
/// own text.
pub(crate) fn describe(text: &[u8], e: &serde_json::Error) -> String {
    if e.classify() != serde_json::error::Category::Data {
        return e.to_string();
    }
    match path_at(text, e.line(), e.column()) {
        path if path.is_empty() => e.to_string(),
        path => format!("{path}: {e}"),
    }
}

/// The path of the value being read at `line`:`column` (1-based, as `serde_json` reports
/// them) of `text`: the keys of the objects and the indices of the arrays around it.
fn path_at(text: &[u8], line: usize, column: usize) -> String {
    let mut stack: Vec<Level> = Vec::new();
    let mut last_string: Option<String> = None;
    let (mut l, mut c) = (1usize, 0usize);
    let mut i = 0;
    while i < text.len() && (l, c) < (line, column) {
        let b = text[i];
        i += 1;
        if b == b'\n' {
            (l, c) = (l + 1, 0);
            continue;
        }
        c += 1;
        match b {
            b'"' => {
                let start = i;
                while i < text.len() && text[i] != b'"' {
                    i += if text[i] == b'\\' { 2 } else { 1 };
                }
                let end = i.min(text.len());
                last_string = Some(String::from_utf8_lossy(&text[start..end]).into_owned());
                c += end - start + 1;
                i = end + 1;
            }
            b'{' => stack.push(Level::Object(None)),
            b'[' => stack.push(Level::Array(0)),
            b'}' | b']' => {
                stack.pop();
            }
            b':' => {
                if let Some(Level::Object(key)) = stack.last_mut() {
                    *key = last_string.take();
                }
            }
            b',' => match stack.last_mut() {
                Some(Level::Array(n)) => *n += 1,
                Some(Level::Object(key)) => *key = None,
                None => {}
            },
            _ => {}
        }
    }
    let mut path = String::new();
    for level in &stack {
        match level {
            Level::Object(Some(key)) => {
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(key);
            }
            Level::Array(n) => path.push_str(&format!("[{n}]")),
            Level::Object(None) => {}
        }
    }
    path
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Inner {
        dp: usize,
        modes: Vec<usize>,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Outer {
        name: String,
        layout: Inner,
    }

    fn error_of(text: &str) -> String {
        let e = serde_json::from_str::<Outer>(text).expect_err(text);
        describe(text.as_bytes(), &e)
    }

    #[test]
    fn a_data_error_names_the_path_of_its_value() {
        let pretty = "{\n  \"name\": \"a:b\",\n  \"layout\": {\n    \"dp\": \"two\",\n    \
                      \"modes\": []\n  }\n}";
        let e = error_of(pretty);
        assert!(
            e.starts_with("layout.dp: invalid type: string \"two\""),
            "{e}"
        );
        let e = error_of(r#"{"name": "x", "layout": {"dp": 1, "modes": [1, -2]}}"#);
        assert!(e.starts_with("layout.modes[1]: invalid value"), "{e}");
        let e = error_of(r#"{"name": "x", "layout": {"dp": 1, "modes": [], "pp": 2}}"#);
        assert!(e.starts_with("layout: unknown field `pp`"), "{e}");
        // A key holding `\"` and a string value holding a colon do not confuse the scan.
        let e = error_of(r#"{"name": "x\":", "layout": {"dp": true, "modes": []}}"#);
        assert!(e.starts_with("layout.dp: invalid type: boolean"), "{e}");
        // A syntax error keeps serde's own text.
        let e = error_of(r#"{"name": "x", "layout": {"dp": 1,,}}"#);
        assert!(e.starts_with("key must be a string"), "{e}");
    }
}
