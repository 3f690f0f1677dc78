//! Module-name globs for policy overrides (`"layers.*.mlp.*"`, `"lm_head"`, `"layers.?.attn.*"`).
//!
//! Rules (the subset of Python's `fnmatch` that names need, without its character classes):
//! - `*` matches any run of characters, empty included, **dots included**: `layers.*.up_proj`
//!   matches `layers.3.mlp.up_proj` (as `fnmatch` does; module names are not paths).
//! - `?` matches exactly one character.
//! - Every other character matches itself, case-sensitively (`[`, `]`, `.` are literals).
//! - The whole name must match: `mlp` does not match `layers.0.mlp`; write `*mlp` or `*.mlp`.
//!
//! The matcher is the classic two-pointer one with a single backtrack point (the last `*`),
//! O(len(pattern) * len(name)) in the worst case, no recursion, no allocation beyond the two
//! char vectors.

/// True when `name` matches `pattern` (rules in the module docs).
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let s: Vec<char> = name.chars().collect();
    let (mut pi, mut si) = (0usize, 0usize);
    // After a `*` at p[star]: retry with the star swallowing one more char, from s[mark].
    let mut backtrack: Option<(usize, usize)> = None;
    while si < s.len() {
        if pi < p.len() && p[pi] == '*' {
            backtrack = Some((pi, si));
            pi += 1;
        } else if pi < p.len() && (p[pi] == '?' || p[pi] == s[si]) {
            pi += 1;
            si += 1;
        } else if let Some((star, mark)) = backtrack {
            pi = star + 1;
            si = mark + 1;
            backtrack = Some((star, mark + 1));
        } else {
            return false;
        }
    }
    // The name is used up: what is left of the pattern must be stars only.
    p[pi..].iter().all(|&c| c == '*')
}

#[cfg(test)]
mod tests {
    use super::glob_match;

    #[test]
    fn literals() {
        assert!(glob_match("lm_head", "lm_head"));
        assert!(!glob_match("lm_head", "lm_head2"));
        assert!(!glob_match("lm_head", "model.lm_head"));
        assert!(!glob_match("LM_HEAD", "lm_head"));
        assert!(glob_match("", ""));
        assert!(!glob_match("", "a"));
        assert!(!glob_match("a", ""));
        assert!(glob_match("a[0]", "a[0]"));
        assert!(!glob_match("a[0]", "a0"));
    }

    #[test]
    fn star() {
        assert!(glob_match("*", ""));
        assert!(glob_match("*", "layers.3.mlp.up_proj"));
        assert!(glob_match("**", "x"));
        assert!(glob_match("layers.*.mlp.*", "layers.3.mlp.up_proj"));
        assert!(glob_match("layers.*.mlp.*", "layers.12.mlp.down_proj"));
        assert!(!glob_match("layers.*.mlp.*", "layers.3.attn.q_proj"));
        assert!(glob_match("*.q_proj", "layers.0.self_attn.q_proj"));
        assert!(glob_match("*proj", "proj"));
        assert!(glob_match("layers.*", "layers."));
        assert!(!glob_match("layers.*", "layers"));
        // `*` crosses dots.
        assert!(glob_match("layers.*.up_proj", "layers.3.mlp.up_proj"));
        // Backtracking: the first candidate for the star is not the right one.
        assert!(glob_match("*a*b", "xaybab"));
        assert!(glob_match("a*a*a", "aaaa"));
        assert!(!glob_match("a*a*a", "aa"));
        assert!(glob_match("*mlp*", "layers.0.mlp"));
        assert!(!glob_match("*.mlp", "mlp"));
    }

    #[test]
    fn question_mark() {
        assert!(glob_match("layers.?.attn", "layers.3.attn"));
        assert!(!glob_match("layers.?.attn", "layers.12.attn"));
        assert!(glob_match("layers.??.attn", "layers.12.attn"));
        assert!(!glob_match("?", ""));
        assert!(glob_match("?*", "a"));
        assert!(!glob_match("?*", ""));
        // One character, not one byte.
        assert!(glob_match("?", "é"));
        assert!(glob_match("x?y", "x.y"));
    }

    #[test]
    fn pathological_stays_fast() {
        let name = "a".repeat(2000);
        let pattern = format!("{}b", "*a".repeat(50));
        assert!(!glob_match(&pattern, &name));
    }
}
