-- pgcascade.find_queue(name) -> the queue row, or an error naming the queue.
create or replace function pgcascade.find_queue(i_queue_name text) returns pgcascade.queue
language plpgsql stable as $$
declare
    q pgcascade.queue;
begin
    select * into q from pgcascade.queue where queue_name = i_queue_name;
    if not found then
        raise exception 'queue "%" does not exist', i_queue_name using errcode = 'P0002';
    end if;
    return q;
end $$;

-- pgcascade.find_subscription(queue, consumer) -> sub_id; errors name what is missing.
-- Locks the subscription row when i_lock is true (next_batch, register moves).
create or replace function pgcascade.find_subscription(i_queue_name text, i_consumer text, i_lock bool default false)
returns pgcascade.subscription
language plpgsql as $$
declare
    s pgcascade.subscription;
    q pgcascade.queue;
begin
    q := pgcascade.find_queue(i_queue_name);
    if i_lock then
        select sub.* into s from pgcascade.subscription sub join pgcascade.consumer c on c.co_id = sub.sub_consumer
         where sub.sub_queue = q.queue_id and c.co_name = i_consumer for update of sub;
    else
        select sub.* into s from pgcascade.subscription sub join pgcascade.consumer c on c.co_id = sub.sub_consumer
         where sub.sub_queue = q.queue_id and c.co_name = i_consumer;
    end if;
    if not found then
        raise exception 'consumer "%" is not registered on queue "%"', i_consumer, i_queue_name
            using errcode = 'P0002';
    end if;
    return s;
end $$;

-- pgcascade.find_batch(batch_id) -> the subscription whose open batch it is, or an error.
create or replace function pgcascade.find_batch(i_batch_id int8) returns pgcascade.subscription
language plpgsql stable as $$
declare
    s pgcascade.subscription;
begin
    select * into s from pgcascade.subscription where sub_batch = i_batch_id;
    if not found then
        raise exception 'batch % is not open (finished already, or never existed)', i_batch_id
            using errcode = 'P0002';
    end if;
    return s;
end $$;
