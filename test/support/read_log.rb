# frozen_string_literal: true

# Prepended to one socket's singleton class (ReadLog.on(socket)): records
# each read_nonblock of it, as [bytes asked for, :bytes] for one that read
# something and [bytes asked for, :wait_readable] for one that found
# nothing (nil at end of file), in #read_log.
module ReadLog
  # @return [IO] `io`, its reads logged from now on
  def self.on(io)
    io.singleton_class.prepend(self)
    io
  end

  # @return [Array<Array(Integer, Symbol, nil)>]
  def read_log
    @read_log ||= []
  end

  def read_nonblock(length, *args, **options)
    super.tap { |data| read_log << [length, data.is_a?(String) ? :bytes : data] }
  end
end
