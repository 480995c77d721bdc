/* SPDX-License-Identifier: MIT */
#ifndef LIBURING_INT_FLAGS
#define LIBURING_INT_FLAGS

enum {
	INT_FLAG_REG_RING	= 1,
};

#endif
