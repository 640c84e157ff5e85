# frozen_string_literal: true

module NeverBlockBench
  # Where a process's memory is, from /proc/PID/smaps: each mapping's Pss,
  # Private_Dirty and Shared (clean + dirty) in kB, summed by kind of mapping.
  # Kinds, by what Linux tells of a mapping (an anonymous mapping does not
  # say who made it, so these are the usual owners, not a certainty):
  #   ruby heap    anonymous, read-write, start and size multiples of 64 KiB
  #                (Ruby's GC heap pages are 64 KiB-aligned mmaps; a malloc
  #                arena's heap also starts so aligned)
  #   malloc brk   [heap]: glibc's main arena, where most malloc'd buffers
  #                (strings, arrays, iseqs, YJIT's metadata) of the main thread go
  #   anon other   other anonymous read-write mappings: large mallocs (mmap'd),
  #                fiber and thread stacks
  #   jit code     anonymous and executable: YJIT's generated code
  #   files        mapped files: the ruby binary, libruby, extensions, locales
  #   stack        [stack]
  module Smaps
    KINDS = ["ruby heap", "malloc brk", "anon other", "jit code", "files", "stack"].freeze
    FIELDS = { "Pss" => :pss, "Private_Dirty" => :private_dirty, "Shared_Clean" => :shared, "Shared_Dirty" => :shared }.freeze
    ALIGN = 64 * 1024

    module_function

    # @return [Hash{String => Hash{Symbol => Integer}}] kB by kind and field
    def of(pid)
      totals = KINDS.to_h { |kind| [kind, Hash.new(0)] }
      kind = nil
      File.foreach("/proc/#{pid}/smaps") do |line|
        if (head = line.match(/\A(\h+)-(\h+) (\S+) \h+ \S+ (\d+)\s*(.*)$/))
          kind = kind_of(head[1].hex, head[2].hex, head[3], head[4].to_i, head[5])
        elsif (field = line.match(/\A(\w+):\s+(\d+) kB/)) && (key = FIELDS[field[1]])
          totals[kind][key] += field[2].to_i
        end
      end
      totals
    end

    def kind_of(start, finish, perms, inode, name)
      return "stack" if name == "[stack]"
      return "malloc brk" if name == "[heap]"
      return "anon other" if name.start_with?("[") # [vdso], [vvar]: the kernel's, tiny
      return "files" if inode.positive? || name.start_with?("/")
      return "jit code" if perms.include?("x")
      return "ruby heap" if perms.start_with?("rw") && (start % ALIGN).zero? && ((finish - start) % ALIGN).zero?

      "anon other"
    end

    # @param label [String] the cell
    # @param processes [Array<Hash>] :pid and :role of each process
    # @return [String] one line per process and kind: Pss, Private_Dirty and Shared, MiB
    def table(label, processes)
      mib = ->(kb) { format("%7.1f", kb / 1024.0) }
      lines = ["smaps of #{label} (MiB: Pss / Private_Dirty / Shared)",
               format("  %-14s %s", "process", KINDS.map { |kind| format("%-24s", kind) }.join)]
      processes.sort_by { |p| [%i[master mold worker].index(p[:role]), p[:pid]] }.each do |process|
        totals = of(process[:pid])
        cells = KINDS.map { |kind| format("%-24s", totals[kind].values_at(:pss, :private_dirty, :shared).map(&mib).join(" ")) }
        lines << format("  %-14s %s", "#{process[:role]} #{process[:pid]}", cells.join)
      rescue SystemCallError => e
        lines << "  #{process[:role]} #{process[:pid]}: #{e.message}"
      end
      lines.join("\n")
    end
  end
end
