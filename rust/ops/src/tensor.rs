//! `Tensor`: an owning `AtenTensorHandle` that frees itself on Drop, with the metadata getters the
//! kernels need.

use std::ffi::c_void;
use std::ptr::NonNull;

use crate::abi::{api, AtenTensorHandle};
use crate::dtype::{DType, Device};
use crate::error::{Error, Op, Result};

pub struct Tensor {
    handle: NonNull<c_void>,
}

// SAFETY: an at::Tensor handle may be used and released from any thread (autograd runs backward on
// its own threads); deepwell never shares one mutably between threads.
unsafe impl Send for Tensor {}

impl Drop for Tensor {
    fn drop(&mut self) {
        // SAFETY: we own the handle (from the stack or from empty_strided) and free it exactly once.
        // The return code is ignored: deleting a valid handle cannot fail.
        unsafe {
            (api().aoti_torch_delete_tensor_object)(self.handle.as_ptr());
        }
    }
}

/// Maps a shim return code to an error naming the call.
fn check(op: Op, call: &'static str, code: i32) -> Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(Error::Torch { op, call })
    }
}

impl Tensor {
    /// Takes ownership of a handle from the boxed stack.
    ///
    /// # Safety
    /// `handle` must be an owning AtenTensorHandle that no one else frees.
    pub unsafe fn from_raw(handle: AtenTensorHandle) -> Option<Tensor> {
        NonNull::new(handle).map(|handle| Tensor { handle })
    }

    /// Gives ownership of the handle away (to the output stack).
    pub fn into_raw(self) -> AtenTensorHandle {
        let h = self.handle.as_ptr();
        std::mem::forget(self);
        h
    }

    fn raw(&self) -> AtenTensorHandle {
        self.handle.as_ptr()
    }

    /// A new contiguous tensor from torch's allocator (the only way deepwell allocates tensors).
    pub fn empty(op: Op, sizes: &[i64], dtype: DType, device: Device) -> Result<Tensor> {
        let _time = crate::host_time::span("aoti_torch_empty_strided");
        let strides = contiguous_strides(sizes);
        let (device_type, device_index) = device.codes(api());
        let mut out: AtenTensorHandle = std::ptr::null_mut();
        // SAFETY: sizes/strides have `sizes.len()` elements; `out` receives a new owning reference.
        let code = unsafe {
            (api().aoti_torch_empty_strided)(
                sizes.len() as i64,
                sizes.as_ptr(),
                strides.as_ptr(),
                dtype.code(),
                device_type,
                device_index,
                &mut out,
            )
        };
        let failed = || Error::Alloc {
            op,
            what: format!(
                "a {} {dtype} tensor on {device} from torch's allocator (its reason, if any, is printed above)",
                crate::check::shape_str(sizes)
            ),
            bytes: sizes.iter().map(|&s| s.max(0) as u128).product::<u128>() * dtype.size().unwrap_or(1) as u128,
        };
        if code != 0 {
            return Err(failed());
        }
        // SAFETY: success returns a new owning handle.
        unsafe { Tensor::from_raw(out) }.ok_or_else(failed)
    }

    /// A second owning handle to the same tensor (shares storage, metadata and version counter).
    pub fn share(&self, op: Op) -> Result<Tensor> {
        let mut out: AtenTensorHandle = std::ptr::null_mut();
        // SAFETY: valid handle; `out` receives a new owning reference.
        let code = unsafe { (api().aoti_torch_new_tensor_handle)(self.raw(), &mut out) };
        check(op, "aoti_torch_new_tensor_handle", code)?;
        // SAFETY: success returns a new owning handle.
        unsafe { Tensor::from_raw(out) }.ok_or(Error::Torch { op, call: "aoti_torch_new_tensor_handle" })
    }

    /// A view of the same storage with other sizes and strides (no copy; the caller keeps it within
    /// the storage). The storage offset is kept.
    pub fn view(&self, op: Op, sizes: &[i64], strides: &[i64]) -> Result<Tensor> {
        debug_assert_eq!(sizes.len(), strides.len());
        let mut out: AtenTensorHandle = std::ptr::null_mut();
        // SAFETY: sizes/strides have `sizes.len()` elements; the last argument is the increment
        // added to the current storage offset (torch::inductor::_reinterpret_tensor).
        let code = unsafe {
            (api().aoti_torch__reinterpret_tensor)(
                self.raw(),
                sizes.len() as i64,
                sizes.as_ptr(),
                strides.as_ptr(),
                0,
                &mut out,
            )
        };
        check(op, "aoti_torch__reinterpret_tensor", code)?;
        // SAFETY: success returns a new owning handle.
        unsafe { Tensor::from_raw(out) }.ok_or(Error::Torch { op, call: "aoti_torch__reinterpret_tensor" })
    }

    /// The transpose of a 2-D tensor, as a view.
    pub fn t(&self, op: Op) -> Result<Tensor> {
        let (s, st) = (self.sizes(), self.strides());
        self.view(op, &[s[1], s[0]], &[st[1], st[0]])
    }

    /// A contiguous tensor seen with other sizes (same numel), as a view.
    pub fn reshape_contiguous(&self, op: Op, sizes: &[i64]) -> Result<Tensor> {
        debug_assert!(self.is_contiguous());
        self.view(op, sizes, &contiguous_strides(sizes))
    }

    pub fn dim(&self) -> usize {
        let mut d = 0i64;
        // SAFETY: valid handle, valid out pointer; cannot fail for a defined tensor.
        unsafe { (api().aoti_torch_get_dim)(self.raw(), &mut d) };
        d as usize
    }

    /// Sizes, borrowed from the tensor (valid while `self` lives; deepwell never resizes inputs).
    pub fn sizes(&self) -> &[i64] {
        self.int_array(api().aoti_torch_get_sizes)
    }

    pub fn strides(&self) -> &[i64] {
        self.int_array(api().aoti_torch_get_strides)
    }

    fn int_array(&self, getter: unsafe extern "C-unwind" fn(AtenTensorHandle, *mut *mut i64) -> i32) -> &[i64] {
        let n = self.dim();
        if n == 0 {
            return &[];
        }
        let mut p: *mut i64 = std::ptr::null_mut();
        // SAFETY: the getter returns a borrowed pointer to `dim()` int64s owned by the tensor.
        unsafe {
            getter(self.raw(), &mut p);
            std::slice::from_raw_parts(p, n)
        }
    }

    pub fn numel(&self) -> usize {
        self.sizes().iter().product::<i64>() as usize
    }

    pub fn dtype(&self) -> DType {
        let mut c = 0i32;
        // SAFETY: valid handle and out pointer.
        unsafe { (api().aoti_torch_get_dtype)(self.raw(), &mut c) };
        DType::from_code(c)
    }

    pub fn device(&self) -> Device {
        let (mut t, mut i) = (0i32, 0i32);
        // SAFETY: valid handle and out pointers.
        unsafe {
            (api().aoti_torch_get_device_type)(self.raw(), &mut t);
            (api().aoti_torch_get_device_index)(self.raw(), &mut i);
        }
        Device::from_codes(api(), t, i)
    }

    /// The address of element 0 (storage offset included).
    pub fn data_ptr(&self) -> *mut c_void {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid handle and out pointer; the pointer is borrowed from the tensor.
        unsafe { (api().aoti_torch_get_data_ptr)(self.raw(), &mut p) };
        p
    }

    /// (bytes the elements span from the storage's start, bytes the storage holds), when the shim
    /// can tell. A tensor whose storage was freed or shrunk (`untyped_storage().resize_(0)`, FSDP2's
    /// resharded parameters) spans more than its storage holds: reading it would fault.
    pub fn storage_span(&self) -> Option<(u128, u128)> {
        let a = api();
        let (size_fn, offset_fn) = (a.aoti_torch_get_storage_size?, a.aoti_torch_get_storage_offset?);
        let (mut size, mut offset) = (0i64, 0i64);
        // SAFETY: valid handle and out pointers.
        let ok = unsafe { size_fn(self.raw(), &mut size) == 0 && offset_fn(self.raw(), &mut offset) == 0 };
        if !ok || self.numel() == 0 {
            return None;
        }
        let last: i128 = self.sizes().iter().zip(self.strides()).map(|(&n, &s)| (n as i128 - 1) * s as i128).sum();
        let elem = self.dtype().size()? as i128;
        Some((((offset as i128 + last + 1) * elem).max(0) as u128, size.max(0) as u128))
    }

    /// True when the strides are the row-major strides of the sizes (size-1 dims ignored).
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1i64;
        for (&size, &stride) in self.sizes().iter().zip(self.strides()).rev() {
            if size != 1 && stride != expected {
                return false;
            }
            expected *= size;
        }
        true
    }

    /// The elements as a slice, for a contiguous tensor whose dtype has elements of type `T`.
    ///
    /// # Safety
    /// The tensor must be contiguous, non-empty, and its dtype's element must be `T`.
    pub unsafe fn as_slice<T>(&self) -> &[T] {
        // SAFETY: guaranteed by the caller; the storage holds numel() elements from data_ptr().
        unsafe { std::slice::from_raw_parts(self.data_ptr() as *const T, self.numel()) }
    }

    /// The elements as a mutable slice, for a tensor deepwell allocated and nobody else holds yet.
    ///
    /// # Safety
    /// As `as_slice`, and no other reference to the storage may exist.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice<T>(&self) -> &mut [T] {
        // SAFETY: guaranteed by the caller.
        unsafe { std::slice::from_raw_parts_mut(self.data_ptr() as *mut T, self.numel()) }
    }
}

pub fn contiguous_strides(sizes: &[i64]) -> Vec<i64> {
    let mut strides = vec![1i64; sizes.len()];
    for i in (0..sizes.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * sizes[i + 1].max(1);
    }
    strides
}
