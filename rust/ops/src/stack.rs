//! Decoding the boxed argument stack into owned Rust values.
//!
//! libtorch fills `stack[0..num_args)` in schema order and hands the kernel ownership of every value
//! (docs/DESIGN.md "The boxed kernel's stack"): tensors are owning handles, `str` is a string handle,
//! `T?` is 0 or a heap box holding the T. `Args::decode` takes ownership of all of them at once, so
//! whatever the kernel does next, every handle is released exactly once by Drop.

use crate::abi::{api, StableIValue, StringHandle};
use crate::dtype::DType;
use crate::error::{Error, Op, Result};
use crate::tensor::Tensor;

/// Schema argument types deepwell uses. Each op's Rust spec lists its arguments with these kinds;
/// `tests/ops/test_registry.py` checks them against the schemas Python defines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Tensor,
    OptTensor,
    Int,
    Float,
    Bool,
    Str,
    ScalarType,
    OptScalarType,
    OptInt,
}

impl Kind {
    /// The schema spelling, for the registry check.
    pub fn schema_type(self) -> &'static str {
        match self {
            Kind::Tensor => "Tensor",
            Kind::OptTensor => "Tensor?",
            Kind::Int => "int",
            Kind::Float => "float",
            Kind::Bool => "bool",
            Kind::Str => "str",
            Kind::ScalarType => "ScalarType",
            Kind::OptScalarType => "ScalarType?",
            Kind::OptInt => "int?",
        }
    }
}

/// The Rust side of one op's schema: its name, arguments in order, and number of returns.
pub struct OpSpec {
    pub name: &'static str,
    pub args: &'static [(&'static str, Kind)],
    pub returns: usize,
}

enum Value {
    Tensor(Option<Tensor>),
    OptTensor(Option<Tensor>),
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    ScalarType(i32),
    OptScalarType(Option<i32>),
    OptInt(Option<i64>),
}

/// The decoded arguments of one call; kernels take them by name.
pub struct Args {
    op: Op,
    values: Vec<(&'static str, Option<Value>)>,
}

/// Reads and frees the heap box of a `T?` argument; None for a null box.
///
/// # Safety
/// `v` must be 0 or a box libtorch allocated for this call.
unsafe fn take_box(v: StableIValue) -> Option<StableIValue> {
    let boxed = v as *mut StableIValue;
    if boxed.is_null() {
        return None;
    }
    // SAFETY: libtorch allocated the box with `new StableIValue`; it is ours to read and free.
    unsafe {
        let inner = *boxed;
        match api().torch_delete_stable_ivalue {
            Some(delete) => {
                delete(boxed);
            }
            None => {
                if let Some(delete) = api().operator_delete {
                    delete(boxed.cast());
                }
            }
        }
        Some(inner)
    }
}

/// Reads and frees a string handle.
///
/// # Safety
/// `h` must be an owning string handle from the stack.
unsafe fn take_string(h: StringHandle) -> String {
    let mut len = 0usize;
    let mut ptr = std::ptr::null();
    // SAFETY: valid owning handle; the c_str pointer is valid until the handle is deleted.
    unsafe {
        (api().torch_string_length)(h, &mut len);
        (api().torch_string_c_str)(h, &mut ptr);
        let s = if ptr.is_null() {
            String::new()
        } else {
            let bytes = std::slice::from_raw_parts(ptr.cast::<u8>(), len);
            String::from_utf8_lossy(bytes).into_owned()
        };
        (api().torch_delete_string)(h);
        s
    }
}

/// `Args`'s accessors of the arguments that arrive as plain values: `fn_name(arg)` is the value
/// of `Value::Variant`, or an internal error where the spec gave the argument another kind.
macro_rules! plain_args {
    ($($fn_name:ident: $variant:ident -> $ty:ty),* $(,)?) => {$(
        pub fn $fn_name(&mut self, name: &'static str) -> Result<$ty> {
            match self.take(name)? {
                Value::$variant(v) => Ok(v),
                _ => Err(self.wrong_kind(name)),
            }
        }
    )*};
}

impl Args {
    /// Takes ownership of `spec.args.len()` values from the stack.
    ///
    /// # Safety
    /// `stack` must hold exactly those arguments, encoded as torch >= 2.10 boxes them for an
    /// extension built against 2.10 (`abi::EXTENSION_BUILD_VERSION`).
    pub unsafe fn decode(op: Op, spec: &OpSpec, stack: *const StableIValue) -> Args {
        let values = spec
            .args
            .iter()
            .enumerate()
            .map(|(i, &(name, kind))| {
                // SAFETY: i < num_args, guaranteed by the caller.
                let v = unsafe { *stack.add(i) };
                // SAFETY: each kind's encoding is documented in docs/DESIGN.md "The boxed kernel's stack".
                let value = unsafe {
                    match kind {
                        Kind::Tensor => Value::Tensor(Tensor::from_raw(v as _)),
                        Kind::OptTensor => Value::OptTensor(take_box(v).and_then(|h| Tensor::from_raw(h as _))),
                        Kind::Int => Value::Int(v as i64),
                        Kind::Float => Value::Float(f64::from_bits(v)),
                        Kind::Bool => Value::Bool(v & 0xff != 0),
                        Kind::Str => Value::Str(take_string(v as _)),
                        Kind::ScalarType => Value::ScalarType(v as i32),
                        Kind::OptScalarType => Value::OptScalarType(take_box(v).map(|c| c as i32)),
                        Kind::OptInt => Value::OptInt(take_box(v).map(|c| c as i64)),
                    }
                };
                (name, Some(value))
            })
            .collect();
        Args { op, values }
    }

    pub fn op(&self) -> Op {
        self.op
    }

    fn take(&mut self, name: &'static str) -> Result<Value> {
        self.values.iter_mut().find(|(n, _)| *n == name).and_then(|(_, v)| v.take()).ok_or_else(|| Error::Internal {
            op: self.op,
            msg: format!("argument '{name}' not in the spec or taken twice"),
        })
    }

    fn wrong_kind(&self, name: &'static str) -> Error {
        Error::Internal { op: self.op, msg: format!("argument '{name}' taken with the wrong kind") }
    }

    pub fn tensor(&mut self, name: &'static str) -> Result<Tensor> {
        match self.take(name)? {
            Value::Tensor(Some(t)) => live_storage(self.op, name, t),
            Value::Tensor(None) => Err(Error::arg(self.op, name, "be a defined tensor", "an undefined tensor")),
            _ => Err(self.wrong_kind(name)),
        }
    }

    pub fn opt_tensor(&mut self, name: &'static str) -> Result<Option<Tensor>> {
        match self.take(name)? {
            Value::OptTensor(t) => t.map(|t| live_storage(self.op, name, t)).transpose(),
            _ => Err(self.wrong_kind(name)),
        }
    }

    plain_args! {
        int: Int -> i64,
        float: Float -> f64,
        bool: Bool -> bool,
        str: Str -> String,
        opt_int: OptInt -> Option<i64>,
    }

    pub fn scalar_type(&mut self, name: &'static str) -> Result<DType> {
        match self.take(name)? {
            Value::ScalarType(v) => Ok(DType::from_code(v)),
            _ => Err(self.wrong_kind(name)),
        }
    }

    pub fn opt_scalar_type(&mut self, name: &'static str) -> Result<Option<DType>> {
        match self.take(name)? {
            Value::OptScalarType(v) => Ok(v.map(DType::from_code)),
            _ => Err(self.wrong_kind(name)),
        }
    }
}

/// A C string for messages built from Rust strings (interior NULs replaced).
pub fn c_message(s: &str) -> std::ffi::CString {
    std::ffi::CString::new(s.replace('\0', " ")).unwrap_or_default()
}

/// `t`, unless its elements reach past its storage (a freed or shrunk storage): kernels would read
/// or write memory torch no longer owns.
fn live_storage(op: Op, name: &'static str, t: Tensor) -> Result<Tensor> {
    match t.storage_span() {
        Some((needed, held)) if needed > held => Err(Error::arg(
            op,
            name,
            format!("have a storage holding its elements ({needed} bytes)"),
            format!("a storage of {held} bytes (freed or resized, e.g. by untyped_storage().resize_(0))"),
        )),
        _ => Ok(t),
    }
}
